"""An out-of-tree rlpipe plugin package: a reward function, an advantage module, an environment.

Registered through the entry points in ``pyproject.toml``: ``rlpipe.rewards:keyword`` is
`rewards.keyword_reward`, ``rlpipe.advantages:reward_to_go`` is `advantages.RewardToGo`,
``rlpipe.environments:codebook`` is `environments.Codebook`.

>>> from rlpipe_example_plugin.rewards import keyword_reward
>>> keyword_reward(["Say"], ["good day"])
[1.0]
"""
