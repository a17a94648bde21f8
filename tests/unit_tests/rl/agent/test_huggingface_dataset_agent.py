"""HuggingFaceDatasetAgent: local JSONL / Parquet / Arrow files, field mapping, rewards, clear file errors."""
import asyncio
import json

import pytest
from pydantic import ValidationError

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.agent.huggingface_dataset_agent import DatasetFileError, HuggingFaceDatasetAgent, load_rows
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.fake import FakeInference

ROWS = [{"question": f"What is {i}+{i}?", "solution": str(2 * i), "uid": f"u{i}"} for i in range(5)]


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def test_field_mapping_template_and_chat(jsonl):
    agent = HuggingFaceDatasetAgent(data_path=str(jsonl), prompt_field="question", answer_field="solution",
                                    id_field="uid", prompt_template="Q: {question}\nA:", chat=True,
                                    system_prompt="Be brief.")
    p = agent.get_problem(3, False)
    assert p["prompt"] == "Q: What is 3+3?\nA:" and p["answer"] == "6" and p["id"] == "u3"
    assert agent.make_prompt(p) == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Q: What is 3+3?\nA:"}]
    assert agent.dataset_size(False) == 5 and agent.dataset_size(True) == 5
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=5, rollouts_per_group=1, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=3, seed=0))))
    assert sorted(g.problem_id for g in out.groups) == [f"u{i}" for i in range(5)]  # one epoch = every row once


@pytest.mark.parametrize("reward_type, completion, expected", [
    ("exact", " 6 ", 1.0), ("exact", "6.", 0.0), ("contains", "it is 6!", 1.0), ("contains", "it is 7", 0.0),
    ("number", "3+3 makes 6", 1.0), ("number", "6 or maybe 7", 0.0), ("number", "no idea", 0.0),
    ("number", "1,006", 0.0),
])
def test_reward_types(jsonl, reward_type, completion, expected):
    agent = HuggingFaceDatasetAgent(data_path=str(jsonl), prompt_field="question", answer_field="solution",
                                    reward_type=reward_type)
    assert agent.compute_reward(agent.get_problem(3, False), completion) == expected


def test_missing_file_and_missing_field_errors(jsonl, tmp_path):
    with pytest.raises(ValidationError, match=r"data_path: dataset file .*nope\.jsonl.* does not exist"):
        HuggingFaceDatasetAgent(data_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValidationError, match="unknown format '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        HuggingFaceDatasetAgent(data_path=str(tmp_path / "x.csv"))
    agent = HuggingFaceDatasetAgent(data_path=str(jsonl), prompt_field="prompt")
    with pytest.raises(DatasetFileError, match="has no field 'prompt'; its fields are: question, solution, uid"):
        agent.get_problem(0, False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DatasetFileError, match=r"bad\.jsonl:2: not valid JSON"):
        load_rows(bad)


def test_parquet_and_arrow_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    ds = datasets.Dataset.from_list(ROWS)
    parquet = tmp_path / "qa.parquet"
    ds.to_parquet(str(parquet))
    arrow = tmp_path / "qa.arrow"
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for path in (parquet, arrow):
        assert load_rows(path) == ROWS
        agent = HuggingFaceDatasetAgent(data_path=str(path), prompt_field="question", answer_field="solution",
                                        max_examples=3)
        assert agent.dataset_size(False) == 3 and agent.get_problem(2, False)["answer"] == "4"
