"""Hub ids resolved from a local Hugging Face cache, offline, laid out as huggingface_hub writes it.

The cache is written by :func:`apertus_plugins.infra.hub.add_to_cache` and read back by huggingface_hub's
own cache scanner and lookups, so the layout is the library's, not ours; every resolution runs with
``HF_HUB_OFFLINE=1`` (no network here, and none is attempted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from apertus_plugins.cli import main
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.infra.hub import METADATA_PATTERNS, HubError, add_to_cache, local_path, parse_hub_id
from apertus_plugins.testing.checkpoint import SIZES, text_config_dict, write_stand_in

REPO = "apertus-test/Apertus-tiny"
SHARDS = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors")


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    """A torch-free stand-in of a released checkpoint in three shards: the embedding, the head, the encoders."""
    spec = VocabSpec.scaled()
    text = text_config_dict(SIZES["tiny"], spec)
    return write_stand_in(tmp_path / "ckpt", {
        SHARDS[0]: {"model.language_model.embed_tokens.weight": [text["vocab_size"], text["hidden_size"]]},
        SHARDS[1]: {"lm_head.weight": [spec.text_size, text["hidden_size"]]},
        SHARDS[2]: {"model.vision_tokenizer.quant_conv.weight": [4, 4], "model.audio_tokenizer.x": [2]}}, spec=spec)


@pytest.fixture()
def cache(apertus_offline_hub: dict[str, str]) -> Path:
    """An empty Hub cache the resolver reads, offline (the ``apertus`` pytest plugin's)."""
    return Path(apertus_offline_hub["HF_HUB_CACHE"])


def test_hub_ids_and_paths_are_told_apart() -> None:
    assert parse_hub_id("swiss-ai/Apertus-v1.5-8B") == ("swiss-ai/Apertus-v1.5-8B", None)
    assert parse_hub_id("swiss-ai/Apertus-v1.5-8B@stage-sft") == ("swiss-ai/Apertus-v1.5-8B", "stage-sft")
    for path in ("/abs/ckpt", "./ckpt", "../ckpt", "~/ckpt", "runs/a/b", "a--b/c", "org/name@", ".hidden", "gpt2",
                 "ckpt@main"):
        assert parse_hub_id(path) is None, path


def test_the_written_cache_is_huggingface_hubs_own_layout(checkpoint: Path, cache: Path) -> None:
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snap = add_to_cache(checkpoint, REPO, cache=cache)
    store = cache / "models--apertus-test--Apertus-tiny"
    assert sorted(p.name for p in store.iterdir()) == ["blobs", "refs", "snapshots"]
    assert (store / "refs" / "main").read_text() == snap.name and len(snap.name) == 40
    links = [f for f in snap.rglob("*") if not f.is_dir()]
    assert links and all(f.is_symlink() and not os.path.isabs(os.readlink(f)) and f.resolve().parent.name == "blobs"
                         for f in links)
    info = scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model" and not info.warnings
    (rev,) = repo.revisions
    assert rev.commit_hash == snap.name and rev.refs == {"main"}
    assert {str(f.file_path.relative_to(snap)) for f in rev.files} == {
        str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()}
    # LFS files are named by their sha256, others by their git blob sha1, as the Hub names them
    import hashlib

    shard = (checkpoint / SHARDS[0]).read_bytes()
    assert os.readlink(snap / SHARDS[0]).endswith(hashlib.sha256(shard).hexdigest())
    config = (checkpoint / "config.json").read_bytes()
    assert os.readlink(snap / "config.json").endswith(hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest())
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=cache) == str(snap / "config.json")


def test_an_id_resolves_to_its_snapshot_with_what_the_caller_needs(checkpoint: Path, cache: Path) -> None:
    snap = add_to_cache(checkpoint, REPO, cache=cache)
    assert local_path(REPO) == snap
    assert local_path(f"{REPO}@main", weights=False) == snap
    assert local_path(f"{REPO}@{snap.name}") == snap
    assert local_path(str(checkpoint)) == checkpoint  # a directory is used as it is


def test_only_the_shards_holding_the_encoders_are_needed(checkpoint: Path, cache: Path) -> None:
    # a cache holding the small files and the encoder shard only, as allow_patterns leaves it
    import fnmatch

    small = [str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    assert all(any(fnmatch.fnmatch(n, pat) for pat in METADATA_PATTERNS) for n in small), small
    snap = add_to_cache(checkpoint, REPO, cache=cache, files=[*small, SHARDS[2]])
    got = local_path(REPO, weights=("model.vision_tokenizer.", "model.audio_tokenizer."))
    assert got == snap and (got / SHARDS[2]).is_file() and not (got / SHARDS[0]).exists()
    assert local_path(REPO, weights=False) == snap  # a tokenizer needs no weights
    with pytest.raises(HubError, match=rf"'{REPO}': the snapshot .* lacks {SHARDS[0]}, {SHARDS[1]} "
                                       r"\(a partial download; HF_HUB_OFFLINE is set\)"):
        local_path(REPO)  # the whole checkpoint: two shards are missing
    with pytest.raises(HubError, match=r"lacks model-00001-of-00003.safetensors \(a partial"):
        local_path(REPO, weights=("model.language_model.",))
    with pytest.raises(HubError, match="names no tensor under model.nothing."):
        local_path(REPO, weights=("model.nothing.",))


def test_an_id_that_is_neither_a_directory_nor_cached_offline_is_a_clear_error(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(HubError, match=r"checkpoint 'swiss-ai/Apertus-v1\.5-8B': not a local directory, and the Hub "
                                       r"model swiss-ai/Apertus-v1\.5-8B is not in the Hugging Face cache .*hf-cache "
                                       r"\(HF_HUB_OFFLINE is set"):
        local_path("swiss-ai/Apertus-v1.5-8B")
    with pytest.raises(HubError, match=r"Apertus-v1\.5-8B@stage-sft is not in the Hugging Face cache"):
        local_path("swiss-ai/Apertus-v1.5-8B@stage-sft", weights=False)
    with pytest.raises(HubError, match=r"checkpoint '/no/such/dir': no such file or directory \(and not a Hub"):
        local_path("/no/such/dir")
    with pytest.raises(HubError, match=r"checkpoint 'ckpt': no such file or directory \(and not a Hub"):
        local_path("ckpt")  # a bare name is a local path


def test_doctor_vocab_and_inspect_take_a_hub_id(checkpoint: Path, cache: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from apertus_plugins.data.indexed import write_indexed_dataset

    add_to_cache(checkpoint, REPO, cache=cache)
    assert main(["doctor", REPO, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoint"].endswith(str(Path("snapshots") / local_path(REPO).name))
    assert report["ok"] and {r["status"] for r in report["checks"]} == {"pass"}, report["checks"]
    assert main(["doctor", "apertus-test/missing", "--json"]) == 2
    assert "apertus-test/missing is not in the Hugging Face cache" in capsys.readouterr().err
    assert main(["vocab", f"{REPO}@main", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == VocabSpec.scaled().size
    spec = VocabSpec.scaled()
    write_indexed_dataset(tmp_path / "ds", [[spec.id("assistant_start"), 100, spec.id("assistant_end")]])
    assert main(["inspect", str(tmp_path / "ds"), "--tokenizer", REPO]) == 0
    assert "<|assistant_end|>" in capsys.readouterr().out


def test_a_release_cached_under_one_spelling_is_found_under_the_other(checkpoint: Path, cache: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from apertus_plugins.infra.release_ids import MODEL_8B, MODEL_70B, TOKENIZER_REPO, canonical, other_spellings

    # the repositories that hold the weights (transformers#47662) are swiss-ai's; apertus-ai's is a served name
    assert MODEL_8B == "swiss-ai/Apertus-v1.5-8B" and MODEL_70B == "swiss-ai/Apertus-v1.5-70B"
    assert other_spellings(MODEL_8B) == ("apertus-ai/Apertus-v1.5-8B",)
    assert other_spellings("apertus-ai/Apertus-v1.5-70B") == (MODEL_70B,)
    assert canonical("Apertus-AI/Apertus-v1.5-8B") == MODEL_8B and canonical(REPO) == REPO
    assert canonical("apertus-ai/Apertus-v1.5-70B-SFT") == "swiss-ai/Apertus-v1.5-70B-SFT"
    assert other_spellings(TOKENIZER_REPO) == () and other_spellings("swiss-ai/Apertus-8B-2509") == ()

    # fetched under vLLM's pull request's spelling, found under the release id (and with a revision) offline
    snap = add_to_cache(checkpoint, "apertus-ai/Apertus-v1.5-8B", cache=cache)
    assert local_path(MODEL_8B) == snap
    assert local_path(f"{MODEL_8B}@main", weights=False) == snap
    assert local_path(MODEL_8B, weights=("model.vision_tokenizer.",)) == snap
    assert not (cache / ("models--" + MODEL_8B.replace("/", "--"))).exists()  # nothing written a second time
    assert main(["doctor", MODEL_8B, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(snap)
    # and the other way round
    snap70 = add_to_cache(checkpoint, MODEL_70B, cache=cache, files=["config.json", "tokenizer.json",
                                                                             "model.safetensors.index.json"])
    assert local_path("apertus-ai/Apertus-v1.5-70B", weights=False) == snap70
    # a snapshot only in part under the other spelling is not used for what it lacks: the error names both
    with pytest.raises(HubError, match=r"'apertus-ai/Apertus-v1\.5-70B': not a local directory, and the Hub model "
                                       r"apertus-ai/Apertus-v1\.5-70B is not in the Hugging Face cache .*"
                                       r"swiss-ai/Apertus-v1\.5-70B \(its other spelling\) is not there whole"):
        local_path("apertus-ai/Apertus-v1.5-70B")
    # each spelling cached on its own: each resolves to its own snapshot
    other = checkpoint.parent / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    own = add_to_cache(other, MODEL_8B, cache=cache)
    assert local_path(MODEL_8B, weights=False) == own != snap
    assert local_path("apertus-ai/Apertus-v1.5-8B", weights=False) == snap
    # an id outside the release is never looked up under another organisation
    with pytest.raises(HubError, match=r"apertus-test/Apertus-v1\.5-8B is not in the Hugging Face cache"):
        local_path("apertus-test/Apertus-v1.5-8B")


def test_every_published_checkpoint_is_known_by_id_with_its_use() -> None:
    from apertus_plugins.infra.release_ids import CHECKPOINTS, MODEL_8B_BASE, MODEL_70B_BASE, MODEL_70B_SFT, checkpoint

    ids = [c.repo_id for c in CHECKPOINTS]
    assert ids == ["swiss-ai/Apertus-v1.5-8B", "swiss-ai/Apertus-v1.5-70B", MODEL_8B_BASE, MODEL_70B_BASE,
                   MODEL_70B_SFT]
    assert MODEL_70B_SFT == "swiss-ai/Apertus-v1.5-70B-SFT" and MODEL_8B_BASE == "swiss-ai/Apertus-v1.5-8B-base"
    assert {c.stage for c in CHECKPOINTS} == {"final", "base", "sft"}
    assert all("continued pretraining" in c.use and "base-model evaluation" in c.use
               for c in CHECKPOINTS if c.stage == "base")
    assert "RL" in checkpoint(MODEL_70B_SFT).use
    assert checkpoint("apertus-ai/Apertus-v1.5-70B-base@main") == checkpoint(MODEL_70B_BASE)
    assert checkpoint("swiss-ai/Apertus-v1.5-8B-SFT") is None and checkpoint("swiss-ai/Apertus-8B-2509") is None
    text = (Path(__file__).resolve().parents[2] / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert all(f"`{i}`" in text for i in ids)  # the docs' table lists every one


def test_the_other_spelling_downloads_from_the_publishing_repository(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, an ``apertus-ai/`` release id in neither spelling's cache is fetched from ``swiss-ai/``."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    asked: list[tuple[str, bool]] = []

    def snapshot_download(repo_id: str, **kw: object) -> str:  # records what would go to the network
        asked.append((repo_id, bool(kw.get("local_files_only"))))
        raise LocalEntryNotFoundError("not here")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(HubError, match=r"the Hub model swiss-ai/Apertus-v1\.5-8B@main could not be fetched"):
        local_path("apertus-ai/Apertus-v1.5-8B@main", weights=False)
    assert [r for r, offline in asked if not offline] == ["swiss-ai/Apertus-v1.5-8B"]
    asked.clear()
    with pytest.raises(HubError, match=r"apertus-test/Apertus-v1\.5-8B could not be fetched"):
        local_path("apertus-test/Apertus-v1.5-8B", weights=False)  # any other id is fetched as given
    assert [r for r, offline in asked if not offline] == ["apertus-test/Apertus-v1.5-8B"]
