"""Running many rollouts: the runner and the service, admission queues, engine hashing, metrics, event-loop
pacing and GC policy (opt-in), datasets."""
