"""core/data/streams.py: prompt files, seeded passes over the prompts, and the PPO-ptx text batches."""

import json
from types import SimpleNamespace

import pytest
import torch

from rlpipe.core.base.files import read_jsonl
from rlpipe.core.data.streams import PromptStream, PtxStream, load_prompts
from rlpipe.core.base.errors import UserError


def write(tmp_path, name, data):
    path = tmp_path / name
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def test_txt_prompts_keep_their_text_and_skip_blank_lines(tmp_path):
    path = write(tmp_path, "p.txt", "\ufeff  first \n\n   \nsecond line\r\nthird")
    assert load_prompts(path) == ["  first ", "second line", "third"]  # BOM dropped, CRLF too


def test_jsonl_prompts_read_the_field(tmp_path):
    rows = [{"prompt": "a", "id": 1}, {"prompt": "b\nc"}, {"text": "t", "prompt": ""}]
    path = write(tmp_path, "p.jsonl", "\n".join(map(json.dumps, rows)) + "\n\n")
    assert load_prompts(path) == ["a", "b\nc", ""]
    ptx = write(tmp_path, "t.jsonl", json.dumps({"text": "hello"}) + "\n")
    assert load_prompts(ptx, field="text") == ["hello"]


@pytest.mark.parametrize("name, data, fragment", [
    ("p.jsonl", '{"prompt": "a"}\n\n{"prompt": 3}\n', "p.jsonl:3: expected an object with a string field 'prompt'"),
    ("p.jsonl", '{"prompt": "a"}\n[1, 2]\n', "p.jsonl:2: expected a JSON object"),
    ("p.jsonl", '{"prompt": "a"\n', "p.jsonl:1: invalid JSON"),
    ("p.jsonl", '{"prompt": 1' + "0" * 5000 + "}\n", "p.jsonl:1: unreadable JSON: ValueError"),
    ("p.jsonl", "[" * 100000 + "]" * 100000 + "\n", "p.jsonl:1: unreadable JSON: RecursionError"),
    ("p.txt", b"ok\nab\xffc\n", "p.txt:2: not UTF-8 text (byte 0xff at column 3)"),
    ("p.jsonl", b'{"prompt": "a"}\n{"prompt": "\xc3"}\n', "p.jsonl:2: not UTF-8 text (byte 0xc3 at column 13)"),
    ("p.txt", "\n \n", "p.txt: no texts found"),
    ("p.csv", "text\nhello\n", "p.csv: unsupported file type '.csv'; use .txt"),  # not its header
])
def test_bad_files_name_file_and_line(tmp_path, name, data, fragment):
    path = write(tmp_path, name, data)
    with pytest.raises(UserError) as err:
        load_prompts(path)
    assert fragment in str(err.value)


def test_missing_file_and_line_numbers_of_jsonl(tmp_path):
    with pytest.raises(UserError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="cannot read"):
        list(read_jsonl(tmp_path / "nope.jsonl"))
    path = write(tmp_path, "r.jsonl", '\n{"a": 1}\n   \n{"b": 2}\n')
    assert list(read_jsonl(path)) == [(2, {"a": 1}), (4, {"b": 2})]


def test_each_pass_is_a_seeded_permutation():
    prompts = [f"p{i}" for i in range(10)]
    stream = PromptStream(prompts, batch_size=4, seed=3)
    served = [p for _ in range(5) for p in stream.next_batch()]  # 20 prompts: two whole passes
    assert sorted(served[:10]) == prompts and sorted(served[10:]) == prompts
    assert served[:10] != served[10:] and served[:10] != prompts  # reshuffled, not the file order
    again = PromptStream(prompts, batch_size=4, seed=3)
    assert [p for _ in range(5) for p in again.next_batch()] == served
    other = PromptStream(prompts, batch_size=4, seed=4)
    assert [p for _ in range(5) for p in other.next_batch()] != served
    assert stream.position == 20


def test_unshuffled_stream_cycles_in_file_order_across_batches():
    stream = PromptStream(["a", "b"], batch_size=5, shuffle=False)
    assert stream.next_batch() == ["a", "b", "a", "b", "a"]
    assert stream.next_batch() == ["b", "a", "b", "a", "b"]
    with pytest.raises(UserError, match="data.batch_size must be >= 1"):
        PromptStream(["a"], batch_size=0)


def test_saved_position_continues_the_same_sequence():
    """What a checkpoint keeps (generator state, remaining order, position) restores the stream."""
    prompts = [str(i) for i in range(7)]
    stream = PromptStream(prompts, batch_size=3, seed=1)
    stream.next_batch()
    state = stream.generator.get_state(), list(stream.order), stream.position
    expected = [stream.next_batch() for _ in range(4)]
    resumed = PromptStream(prompts, batch_size=3, seed=99)
    resumed.generator.set_state(state[0])
    resumed.order, resumed.position = list(state[1]), state[2]
    assert [resumed.next_batch() for _ in range(4)] == expected
    assert resumed.position == 15


def test_ptx_batches_are_padded_labelled_and_shared_between_ranks(tmp_path, tiny_tokenizer):
    texts = ["the cat sat on the mat", "a dog", "hello world", "one two three four"]
    path = write(tmp_path, "ptx.txt", "\n".join(texts))
    cfg = SimpleNamespace(data=path, batch_size=2, max_tokens=4)
    shares = []
    for rank in range(2):
        batch = PtxStream(cfg, tiny_tokenizer, SimpleNamespace(rank=rank, world=2)).next_batch("cpu")
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.shape[0] == 2
        for row_ids, row_mask, row_labels in zip(ids, mask, labels):
            n = int(row_mask.sum())
            assert row_mask.tolist() == [1] * n + [0] * (ids.shape[1] - n)  # right-padded
            assert (row_ids[n:] == tiny_tokenizer.pad_token_id).all()
            assert row_labels.tolist() == row_ids[:n].tolist() + [-100] * (ids.shape[1] - n)
            assert row_ids[0] == tiny_tokenizer.bos_token_id and n <= cfg.max_tokens
        shares.append([tiny_tokenizer.decode(r[1:int(m.sum())]) for r, m in zip(ids, mask)])
    cut = [" ".join(t.split()[:3]) for t in texts]  # BOS + 3 words = max_tokens
    assert sorted(shares[0] + shares[1]) == sorted(cut)  # the ranks split one global batch


def test_ptx_pads_with_eos_when_there_is_no_pad_token(tmp_path, tiny_tokenizer_no_pad):
    path = write(tmp_path, "ptx.txt", "the cat\na dog sat on the mat")
    cfg = SimpleNamespace(data=path, batch_size=2, max_tokens=32)
    batch = PtxStream(cfg, tiny_tokenizer_no_pad, SimpleNamespace(rank=0, world=1)).next_batch("cpu")
    short = int(torch.argmin(batch["attention_mask"].sum(-1)))
    padding = batch["input_ids"][short][batch["attention_mask"][short] == 0]
    assert padding.numel() > 0 and (padding == tiny_tokenizer_no_pad.eos_token_id).all()
