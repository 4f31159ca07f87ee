"""Fine-tuning as HF users expect it: optimizer groups, schedules, accumulation, evaluation, metrics, the loop
behind fxpar train."""
