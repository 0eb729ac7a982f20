"""What the tests share: paths and environments (paths), the single-process reference training
(reference), the tiny configuration, the mutation check and torchrun runs (runs), tolerances
(tolerance), schedule helpers (schedules), the segment harness (segments) and a character
tokenizer (tokenizers)."""
