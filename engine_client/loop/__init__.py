"""The engine loop: request, scheduler (schedule), runner (run), postprocess, sampler, metrics,
and the state file that lets a restarted engine resume its requests."""
