"""An environment: the model looks a name's code up with a tool, then answers it.

It passes rlpipe's conformance kit (``rlpipe.testing.check_environment``): it declares its tool's
JSON schema and ``deterministic=True`` (the seed alone picks the names and codes), keeps only
plain data (so it pickles), answers a malformed or unknown tool call with an ``error:`` message,
and its ``step`` is ``async def`` (rlpipe runs it on its event loop).

>>> import asyncio
>>> env = Codebook()
>>> env.reset({"prompt": ""}, seed=3)
[{'role': 'user', 'content': 'What is the code of Orrin? Look it up with the lookup tool, then answer with the code.'}]
>>> asyncio.run(env.step('<tool_call>{"name": "lookup", "arguments": {"name": "Orrin"}}</tool_call>'))
([{'role': 'tool', 'name': 'lookup', 'content': '2136'}], 0.0, False, {'tool_calls': 1, 'tool_errors': 0, 'timeouts': 0})
>>> asyncio.run(env.step("The code is 2136."))
([], 1.0, True, {'tool_calls': 0, 'tool_errors': 0, 'timeouts': 0})
"""

import random

from rlpipe.plugin import EnvironmentContract, parse_tool_calls

NAMES = ("Zorvak", "Amsel", "Vell", "Orrin", "Tamsa", "Quill")
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The code on file for a name.",
    "parameters": {"type": "object", "required": ["name"],
                   "properties": {"name": {"type": "string", "description": "the name"}}}}}


class Codebook:
    """Each conversation asks for one name's four-digit code; reward 1.0 for the right code in
    the final answer (a turn without a tool call), else 0.0.

    Config keys: ``max_turns`` (4), ``timeout_s`` (5.0).
    """

    @classmethod
    def contract(cls, max_turns: int = 4, timeout_s: float = 5.0) -> EnvironmentContract:
        return EnvironmentContract(max_turns=max_turns, tools=(LOOKUP,), timeout_s=timeout_s,
                                   deterministic=True)

    def __init__(self, max_turns: int = 4, timeout_s: float = 5.0):
        self.codes: dict[str, str] = {}
        self.asked = ""

    def reset(self, row: dict, seed: int) -> list[dict]:
        draw = random.Random(seed)
        self.codes = {name: f"{draw.randrange(10_000):04d}" for name in NAMES}
        self.asked = draw.choice(NAMES)
        return [{"role": "user", "content": f"What is the code of {self.asked}? Look it up with "
                                            f"the lookup tool, then answer with the code."}]

    async def step(self, action: str) -> tuple[list[dict], float, bool, dict]:
        calls, errors = parse_tool_calls(action)
        info = {"tool_calls": len(calls), "tool_errors": len(errors), "timeouts": 0}
        if not calls and not errors:   # the final answer
            return [], float(self.codes[self.asked] in action), True, info
        messages = [{"role": "tool", "content": f"error: {error}"} for error in errors]
        for call in calls:
            name = call.arguments.get("name")
            if call.name != "lookup" or not isinstance(name, str):
                info["tool_errors"] += 1
                text = f"error: the only tool is lookup(name: str), got {call.name}({call.arguments})"
            else:
                text = self.codes.get(name, f"no code on file for {name!r}")
            messages.append({"role": "tool", "name": call.name, "content": text})
        return messages, 0.0, False, info
