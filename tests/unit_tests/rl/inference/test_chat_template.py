"""Chat rendering: HF template when the tokenizer has one, our Tokenizer's method, else the built-in one."""
from transformers import AutoTokenizer

from megatron.rl.inference import ChatMessage
from megatron.rl.inference.chat_template import builtin_chat_template, render_chat
from megatron.rl.training.tokenizer import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model

MSGS = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="2+2?")]


def test_builtin_template_exact_text():
    assert builtin_chat_template(MSGS) == "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n"
    assert builtin_chat_template(MSGS, add_generation_prompt=False) == "<|system|>\nBe brief.\n<|user|>\n2+2?\n"
    assert render_chat([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


def test_hf_template_used_when_present_else_builtin(tmp_path):
    with_t = AutoTokenizer.from_pretrained(build_tiny_hf_model(tmp_path / "a", chat_template=True),
                                           local_files_only=True)
    without = AutoTokenizer.from_pretrained(build_tiny_hf_model(tmp_path / "b", chat_template=False),
                                            local_files_only=True)
    assert render_chat(MSGS, with_t) == "[system]: Be brief.\n[user]: 2+2?\n[assistant]: "
    assert render_chat(MSGS, without) == builtin_chat_template(MSGS)
    # our own Tokenizer wrappers go through their apply_chat_template
    assert render_chat(MSGS, HuggingFaceTokenizer(str(tmp_path / "a"))) == render_chat(MSGS, with_t)
    assert render_chat(MSGS, HuggingFaceTokenizer(str(tmp_path / "b"))) == builtin_chat_template(MSGS)
    assert render_chat(MSGS, ByteLevelTokenizer()) == builtin_chat_template(MSGS)
