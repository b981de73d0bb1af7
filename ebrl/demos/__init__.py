"""Demonstrations: LeRobot-format datasets, scripted experts, collection, and SFT from them."""

from ebrl.demos.collect import DEMO_SEED, collect
from ebrl.demos.experts import expert_for
from ebrl.demos.features import ObsFeatures
from ebrl.demos.lerobot import Demos, LeRobotWriter, read_lerobot

__all__ = ["DEMO_SEED", "Demos", "LeRobotWriter", "ObsFeatures", "collect", "expert_for", "read_lerobot"]
