"""Baselines that ``diloco bench`` compares Decoupled DiLoCo with: data-parallel training
(:mod:`diloco.baselines.dp`) and torchft's DiLoCo (:mod:`diloco.baselines.torchft`)."""
