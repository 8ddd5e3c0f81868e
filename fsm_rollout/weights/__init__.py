"""Weight updates during rollouts: the suspension gate and per-token versions, turns generated in several
requests, and the resume state of a handed-back sample."""
