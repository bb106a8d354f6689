"""core/data/prompts.py: every input format through Hugging Face `datasets`, chat prompts, the
columns that travel with samples, and the one-line errors of bad data."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.data.prompts import PromptData, chat_text, load_prompt_data

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
ROWS = [{"prompt": "one plus one", "answer": 2, "name": "a"},
        {"prompt": "two plus two", "answer": 4, "name": "b"},
        {"prompt": "the cat", "answer": 7, "name": "c"}]
EXPECTED = {"prompts": [r["prompt"] for r in ROWS],
            "columns": {"answer": [2, 4, 7], "name": ["a", "b", "c"]}}


def table():
    return datasets.Dataset.from_list(ROWS)


def written(tmp_path, fmt):
    """ROWS in format ``fmt`` under ``tmp_path``; returns the path to give data.prompts."""
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        table().to_parquet(str(path))
    elif fmt == "csv":
        table().to_csv(str(path), index=False)
    elif fmt == "disk":
        datasets.DatasetDict({"train": table(), "test": table().select([0])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_every_file_format_gives_prompts_and_columns(tmp_path, fmt):
    data = load_prompt_data(written(tmp_path, fmt))
    assert data.prompts == EXPECTED["prompts"] and data.columns == EXPECTED["columns"]
    assert data.kinds == {"answer": "int", "name": "object"} and not data.chat


def test_txt_keeps_one_prompt_a_line_and_a_dataset_object_is_taken_as_it_is(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\ufefffirst \n\n  \nsecond\r\n")
    data = load_prompt_data(path)
    assert data.prompts == ["first ", "second"] and data.columns == {}
    assert load_prompt_data(table()).columns == EXPECTED["columns"]
    split = load_prompt_data(datasets.DatasetDict({"test": table()}), split="test")
    assert split.prompts == EXPECTED["prompts"]
    assert load_prompt_data(written(tmp_path, "disk"), split="test").prompts == ["one plus one"]


def test_a_hub_dataset_resolves_from_the_local_cache_offline(tmp_path):
    """A Hub-style cache (``HF_DATASETS_CACHE/owner___name/config/version/hash``, what an online
    ``load_dataset("owner/name")`` leaves) built here; offline, the name resolves from it, and an
    uncached name is one line saying what was looked for and where."""
    cache = tmp_path / "hf" / "datasets"
    files = {"train": str(written(tmp_path, "parquet"))}
    datasets.load_dataset("parquet", data_files=files, cache_dir=str(cache))
    built = next(p for p in (cache / "parquet").glob("*/*/*") if p.is_dir())
    target = cache / "me___arith" / "default" / "0.0.0" / built.name
    shutil.copytree(built, target)
    for arrow in target.glob("parquet-*.arrow"):
        arrow.rename(target / arrow.name.replace("parquet-", "arith-"))
    shutil.rmtree(cache / "parquet")
    code = ("import json, sys\nfrom rlpipe.core.data.prompts import load_prompt_data\n"
            "from rlpipe.core.base.errors import UserError\n"
            "d = load_prompt_data('me/arith')\nprint(json.dumps([d.prompts, d.columns]))\n"
            "try:\n    load_prompt_data('nobody/nothing')\nexcept UserError as e:\n    print(e)\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, error = out.stdout.splitlines()
    assert json.loads(found) == [EXPECTED["prompts"], EXPECTED["columns"]]
    assert "'nobody/nothing' is not a file or folder" in error and str(cache) in error
    assert out.stderr == ""  # datasets' own warnings stay quiet


def test_chat_messages_with_a_system_turn_go_through_the_template(tiny_tokenizer):
    chats = [[{"role": "system", "content": "be small"}, {"role": "user", "content": "the cat"}],
             [{"role": "user", "content": "a dog"}, {"role": "assistant", "content": "sat"},
              {"role": "user", "content": "and"}]]
    data = load_prompt_data(datasets.Dataset.from_dict({"messages": chats, "answer": [1, 2]}),
                            prompt_key="messages")
    assert data.chat and data.columns == {"answer": [1, 2]}
    data.use_tokenizer(tiny_tokenizer)
    assert data.texts([0, 1]) == [
        "system : be small user : the cat assistant : ",
        "user : a dog assistant : sat user : and assistant : "]


def test_a_chat_row_the_template_refuses_fails_before_training(tiny_tokenizer):
    """Only row 1 was tried at start: a bad row 3 stopped the run whenever it was sampled."""
    tiny_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
        "{{ raise_exception('a conversation starts with a user turn') }}{% endif %}"
        "{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant : ")
    chats = [[{"role": "user", "content": "the cat"}]] * 2 + [[{"role": "assistant", "content": "x"}]]
    data = load_prompt_data(datasets.Dataset.from_dict({"prompt": chats}))
    with pytest.raises(UserError, match="data.prompts row 3: the chat template failed: .*starts "
                                        "with a user turn"):
        data.use_tokenizer(tiny_tokenizer)


def test_a_template_that_writes_bos_does_not_give_two(tiny_tokenizer):
    """The tiny tokenizer adds <s> itself; a template that writes it too would double it when
    the collector encodes the text."""
    tiny_tokenizer.chat_template = "<s>" + tiny_tokenizer.chat_template
    messages = [{"role": "user", "content": "the cat"}]
    raw = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tiny_tokenizer(raw)["input_ids"].count(tiny_tokenizer.bos_token_id) == 2  # the trap
    ids = tiny_tokenizer(chat_text(tiny_tokenizer, messages))["input_ids"]
    assert ids[0] == tiny_tokenizer.bos_token_id and ids.count(tiny_tokenizer.bos_token_id) == 1


def test_chat_without_a_template_is_one_line(tiny_tokenizer):
    tiny_tokenizer.chat_template = None
    data = load_prompt_data(datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "hi"}]]}))
    with pytest.raises(UserError, match="chat messages but the actor's tokenizer has no chat template"):
        data.use_tokenizer(tiny_tokenizer)


def test_attach_repeats_each_row_for_its_samples_in_group_order():
    data = PromptData(["p0", "p1", "p2"], {"answer": [1, 2, 3], "score": [0.5, 1.5, 2.5],
                                           "ok": [True, False, True], "name": ["x", "y", "z"],
                                           "tests": [[1], [2, 2], None]},
                      kinds={"answer": "int", "score": "float", "ok": "bool", "name": "object",
                             "tests": "object"})
    batch = TensorDict({S.GROUP_ID: torch.tensor([0, 0, 1, 1])}, batch_size=[4])
    data.attach(batch, rows=[2, 0])  # this call's prompts were rows 2 and 0
    assert batch[S.DATA, "answer"].tolist() == [3, 3, 1, 1]
    assert batch[S.DATA, "answer"].dtype == torch.int64
    assert batch[S.DATA, "score"].dtype == torch.float64
    assert batch[S.DATA, "ok"].tolist() == [True, True, True, True]
    assert list(batch[S.DATA, "name"]) == ["z", "z", "x", "x"]
    assert list(batch[S.DATA, "tests"]) == [None, None, [1], [1]]
    assert batch[S.DATA, "score"].tolist() == [2.5, 2.5, 0.5, 0.5]
    assert S.SCORE not in batch.keys()  # a "score" column stays nested: no collision


@pytest.mark.parametrize("rows, key, fragment", [
    ([{"text": "a", "answer": 1}], "prompt", "no column 'prompt'; columns: text, answer"),
    ([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}], "prompt",
     "mixed prompt types: row 1 is a string, row 2 is a list of chat messages"),
    ([{"prompt": "a"}, {"prompt": None}], "prompt", "row 2: 'prompt' must be a string or a list"),
    ([{"prompt": [{"role": "user"}]}], "prompt", "row 1: 'prompt' must be a string or a list"),
])
def test_bad_rows_are_one_line(tmp_path, rows, key, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as err:
        load_prompt_data(path, prompt_key=key)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_bad_files_name_the_file_and_row(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(UserError, match=r"broken.jsonl:2: invalid JSON"):
        load_prompt_data(broken)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(UserError, match=r"corrupt.parquet: cannot read as parquet"):
        load_prompt_data(corrupt)
    odd = tmp_path / "rows.xlsx"
    odd.write_bytes(b"\x00")
    with pytest.raises(UserError, match=r"unsupported file type '.xlsx'"):
        load_prompt_data(odd)
    with pytest.raises(UserError, match="split 'train' has no rows"):
        load_prompt_data(datasets.Dataset.from_dict({"prompt": []}))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(UserError, match="empty.csv is empty"):
        load_prompt_data(tmp_path / "empty.csv")
    with pytest.raises(UserError, match="has no split 'dev'; splits: train, test"):
        load_prompt_data(written(tmp_path, "disk"), split="dev")


def write_config(tmp_path, data_path, *extra_rewards):
    import yaml

    raw = yaml.safe_load(TINY.read_text())
    raw["models"]["actor"]["path"] = str(TINY.parent / "model")
    raw["data"]["prompts"] = str(data_path)
    raw["rewards"] += list(extra_rewards)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_cli_errors_come_before_any_model_is_built(tmp_path, harness):
    data = written(tmp_path, "jsonl")
    config = write_config(tmp_path, data, {"name": "answer_match", "column": "solution"})
    result = harness.run(["run", config, f"run.output_dir={tmp_path / 'r'}", "--no-progress"])
    harness.error(result, "reward 'answer_match' reads column 'solution'",
                  "columns: answer, name")


def test_data_errors_come_before_the_run_directory(tmp_path):
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.run.pipeline import Pipeline

    config = write_config(tmp_path, written(tmp_path, "jsonl"))
    out = tmp_path / "never"
    cfg = load_config(config, [f"run.output_dir={out}", "data.prompt_key=question"])
    with pytest.raises(UserError, match="data.prompts: no column 'question'; columns: prompt, "
                                        "answer, name"):
        Pipeline(cfg, progress=False)
    with pytest.raises(UserError, match="file not found: .*missing.parquet"):
        load_config(config, [f"data.prompts={tmp_path / 'missing.parquet'}"])
    with pytest.raises(UserError, match="data.prompts: required .* or pass dataset="):
        Pipeline(load_config(config, [f"run.output_dir={out}", "data.prompts=null"]))
    assert not out.exists()
