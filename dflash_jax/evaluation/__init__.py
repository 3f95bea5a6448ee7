"""Measuring the engine: the paper's benchmark protocol (``bench``), per-round timings and the speedup bound
(``speed``), the prompt sets they read (``prompts``) and the machine they ran on (``machine``)."""
