"""The service's CPU cost of one StepEnd."""
