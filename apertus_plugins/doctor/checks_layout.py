"""The image layout of the training data against the serving endpoint's (SPEC.md 2.1).

Datasets are given as manifests (``apertus manifest`` / the offline pipeline: the layout a
dataset was written in is recorded in its entry's ``metadata.image_layout``) or as indexed
dataset prefixes (the layout is then read off the first documents that hold images). The
serving layout is the one the ``--serve`` endpoint put into an image prompt, else the serving
default of the image modality (the released processor's inference layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from apertus_plugins.core.media.image import dataset_image_layouts

from .checkpoint_files import DoctorError
from .registry import Context, check
from .report import PASS, WARN

__all__ = ["dataset_layouts", "serving_default_layout"]

_SCAN_DOCUMENTS = 64


def serving_default_layout() -> str:
    """The layout a server uses unless told otherwise (:func:`apertus_plugins.plugins.serving_layout`)."""
    from apertus_plugins.plugins import serving_layout

    return serving_layout("image")


def _detect(prefix: str, spec: Any) -> str | None:
    from apertus_plugins.data.indexed import IndexedDataset, IndexedDatasetError

    try:
        ds = IndexedDataset(prefix)
    except (IndexedDatasetError, OSError) as exc:
        raise DoctorError(f"{prefix}: not a readable indexed dataset ({exc})") from exc
    found = dataset_image_layouts(ds, spec, limit=_SCAN_DOCUMENTS)
    if not found:
        return None
    return found.pop() if len(found) == 1 else "mixed"


def dataset_layouts(path: str | os.PathLike[str], spec: Any) -> list[dict[str, Any]]:
    """``[{"dataset", "layout", "source"}]`` for a manifest (each entry) or one indexed prefix.

    ``layout`` is ``"inference"``, ``"training"``, ``"mixed"`` or ``None`` (no image found).
    """
    from apertus_plugins.data.manifest import ManifestError, read_manifest

    p = Path(path)
    if p.suffix == ".json" or (p.is_file() and not p.with_suffix(".idx").is_file()):
        try:
            manifest = read_manifest(p)
        except ManifestError as exc:
            raise DoctorError(str(exc)) from exc
        out = []
        for entry in manifest["datasets"]:
            prefix = str(entry.get("prefix"))
            layout = (entry.get("metadata") or {}).get("image_layout")
            if layout:
                out.append({"dataset": prefix, "layout": layout, "source": f"{p.name} metadata"})
                continue
            local = prefix if Path(prefix + ".idx").is_file() else str(p.parent / prefix)
            out.append({"dataset": prefix, "layout": _detect(local, spec), "source": "read from its documents"})
        return out
    prefix = str(p.with_suffix("")) if p.suffix in (".bin", ".idx") else str(p)
    return [{"dataset": prefix, "layout": _detect(prefix, spec), "source": "read from its documents"}]


@check("layout.image", "the training data and the serving endpoint use the same image layout")
def image_layout(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    default = serving_default_layout()
    if ctx.server is not None:
        from .checks_serve import image_probe

        try:
            serving, where = image_probe(ctx)["layout"], "the served endpoint"
        except Exception as exc:  # serve.image fails for it; the layout is then unknown, not skewed
            return WARN, f"the serving layout is unknown: the image request failed ({exc}); see serve.image", {}
    else:
        serving, where = default, "the serving default (no --serve)"
    rows: list[dict[str, Any]] = []
    for path in ctx.datasets:
        rows.extend(dataset_layouts(path, ctx.ref))
    details = {"serving": serving, "datasets": rows}
    with_images = [r for r in rows if r["layout"]]
    if not rows:
        if serving != default:
            return WARN, (f"{where} uses the {serving} layout, the released processor the {default} one; "
                          "no dataset given (--dataset)"), details
        return PASS, f"{where} uses the {serving} layout; no dataset given (--dataset)", details
    if not with_images:
        return PASS, f"{where} uses the {serving} layout; the {len(rows)} dataset(s) hold no images", details
    skewed = [r for r in with_images if r["layout"] != serving]
    if skewed:
        names = ", ".join(f"{Path(r['dataset']).name}: {r['layout']} ({r['source']})" for r in skewed[:3])
        markers = f"{ctx.ref.literal('img_end_of_row')} and {ctx.ref.literal('img_end_of_frame')}"
        return WARN, (f"train/serve layout skew: {names}; {where} uses {serving} (the training layout ends each "
                      f"image with a trailing {markers}, SPEC 2.1)"), details
    return PASS, f"{len(with_images)} dataset(s) and {where} all use the {serving} layout", details
