"""ZeRO stages: gradient and optimizer-state partitioning (0-2); parameter partitioning (3)."""
