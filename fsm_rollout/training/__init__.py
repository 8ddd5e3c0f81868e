"""What a trainer does with the rollouts' samples."""
