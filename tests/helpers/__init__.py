"""What the tests share: paths and environments (paths), the single-process reference training
(reference), the tiny configuration, the mutation check and torchrun runs (runs), tolerances
(tolerance), schedule helpers (schedules), the segment harness (segments) and a character
tokenizer (char_tokenizer). A worker script started from this folder has it on ``sys.path``, so no
module here takes an installed package's name (``tests/pure/test_module_length.py``)."""
