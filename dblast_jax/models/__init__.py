"""The networks in Flax NNX: the target decoder LM (`target`) and the DBlast drafter
(`drafter`), with their shared layers."""
