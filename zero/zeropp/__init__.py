"""ZeRO++'s compressed collectives: qwZ, stage 3's all-gather of int8 weight blocks
(zero/zeropp/blocks.py, zero/zeropp/gather.py). hpZ's secondary shards live with the units
(zero/stages/unit.py, [Note: hpZ])."""
