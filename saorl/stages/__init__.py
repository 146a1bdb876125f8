"""What runs before or beside RL: the SFT warm start, value pretraining and evaluation."""
