"""What the tests share: paths and environments (paths), the single-process reference training
(reference), the tiny configuration and torchrun runs (runs), tolerances (tolerance),
schedule helpers (schedules) and the segment harness (segments)."""
