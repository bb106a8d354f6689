"""A plain reward function: rlpipe wraps it into a reward component by itself."""


def keyword_reward(prompts: list[str], responses: list[str], *, word: str = "good",
                   **batch) -> list[float]:
    """1.0 for each response that contains ``word`` (case-sensitive), else 0.0.

    ``word`` is the config key; rlpipe passes the other batch entries as keyword arguments,
    which this reward does not need (hence ``**batch``).

    >>> keyword_reward(["Hi", "Hi"], ["a good day", "a bad day"], word="good")
    [1.0, 0.0]
    """
    return [1.0 if word in response else 0.0 for response in responses]
