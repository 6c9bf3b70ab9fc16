"""The token record that ``rollout`` and ``gateway`` both build on: an episode's growing record
(``episode``, ``record``), forking it at a point (``record.fork_record``), the trajectory's JSON
form (``codec``), the crash-safe JSONL writer (``writer``) and the seeds (``seeds``). It sits below
both, so the turn loop and the gateway share one floor."""
