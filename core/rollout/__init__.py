"""The rollout side: data, engines, the rollout manager, rewards and evaluation."""
