"""vLLM's side of scripts/peer_vllm_processor.sh: a worker run in vLLM's own venv.

It builds vLLM's multimodal processor for a model folder (no weights, no engine) and times
what vLLM's renderer does per request with its processor cache off: tokenize the prompt,
parse the media, ``processor.apply`` (HF processor + prompt updates). Items get request-id
UUIDs, as the renderer gives them when ``mm_processor_cache_gb=0`` and prefix caching is off,
so nothing is content-hashed (our side, ProcessorCache(0), hashes nothing either).

Families whose vLLM model normalizes pixels on the device (``mm_device_do_normalize``, on by
default for Qwen2/2.5/3-VL: the processor returns uint8 pixels, rescale and normalize run in
the model) get a second processor, ``host_norm`` (``mm_device_do_normalize=False``), whose
pixels are the HF processor's float tensors, as ours are: both are timed.

Protocol: one JSON command per line on stdin, one JSON answer per line on the original
stdout (everything else anything prints goes to stderr):
  {"cmd": "load", "folder": F, "limits": {"image": 1}}  -> the variants built, class names
  {"cmd": "case", "id": I, "prompt": P, "modality": M, "media": FILE.npy, "metadata": {...},
   "save": PREFIX}  -> per variant one processed output (prompt ids; tensors saved to
                       PREFIX-<variant>.npz) and the reference HF processor call
                       (AutoProcessor on the folder, this venv's transformers)
  {"cmd": "time", "id": I, "variant": V, "n": N}  -> N timed calls, seconds (wall, and the
                                                      process's CPU time)
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

STATE: dict = {"cases": {}}
_ARG = {"image": "images", "video": "videos", "audio": "audio"}


def answer(obj: dict) -> None:
    PROTO.write(json.dumps(obj) + "\n")


def media_data(modality: str, path: str, metadata: dict | None):
    arr = np.load(path)
    if modality == "image":
        from PIL import Image
        return Image.fromarray(arr)
    if modality == "video":
        if metadata is not None:  # families that write timestamps: (frames, metadata)
            return (arr, dict(metadata, do_sample_frames=False))
        return arr
    return (arr.astype(np.float32), 16_000)


def load(cmd: dict) -> dict:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    folder = cmd["folder"]

    def build(**extra):
        mc = ModelConfig(model=folder, tokenizer=folder, dtype="float32",
                         mm_processor_cache_gb=0, limit_mm_per_prompt=cmd["limits"], **extra)
        return mc, MULTIMODAL_REGISTRY.create_processor(mc)

    mc, proc = build()
    procs = {"default": proc}
    device_norm = bool(mc.multimodal_config.mm_device_do_normalize)
    if device_norm:
        procs["host_norm"] = build(mm_device_do_normalize=False)[1]
    hf = proc.info.get_hf_processor()
    STATE.pop("ref_proc", None)
    STATE.update(procs=procs, tok=proc.info.get_tokenizer(), folder=folder, cases={})
    classes = {"vllm": type(proc).__name__, "hf": type(hf).__name__}
    for attr in ("image_processor", "video_processor", "feature_extractor"):
        sub = getattr(hf, attr, None)
        if sub is not None:
            classes[attr] = type(sub).__name__
    import transformers
    import vllm
    return {"ok": True, "classes": classes, "variants": list(procs),
            "mm_device_do_normalize": device_norm,
            "versions": {"vllm": vllm.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def run_once(case: dict, variant: str):
    from vllm.multimodal.processing import ProcessorInputs, TimingContext

    proc, tok = STATE["procs"][variant], STATE["tok"]
    ids = tok.encode(case["prompt"])
    items = proc.info.parse_mm_data({case["modality"]: [case["data"]]})
    uuids = {m: [f"req-{m}-{i}" for i in range(n)] for m, n in items.get_all_counts().items()}
    return proc.apply(ProcessorInputs(ids, items, uuids, cache=None), TimingContext(enabled=False))


def tensors_of(out) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for items in out["mm_kwargs"].values():
        for item in items:
            for key, value in item.get_data().items():
                if isinstance(value, torch.Tensor):
                    arrays[key] = value.detach().float().numpy() if value.is_floating_point() \
                        else value.numpy()
    return arrays


def reference(case: dict) -> list[int]:
    """This venv's HF processor called directly on the whole prompt (the reference)."""
    from transformers import AutoProcessor

    if "ref_proc" not in STATE:
        STATE["ref_proc"] = AutoProcessor.from_pretrained(STATE["folder"])
    data, extra = case["data"], {}
    if case["modality"] == "audio":
        data, extra["sampling_rate"] = data
    elif case["modality"] == "video" and isinstance(data, tuple):
        data, meta = data
        extra.update(do_sample_frames=False,
                     video_metadata=[{k: v for k, v in meta.items() if k != "do_sample_frames"}])
    out = STATE["ref_proc"](text=[case["prompt"]], **{_ARG[case["modality"]]: [data]},
                            return_tensors="pt", **extra)
    return out["input_ids"][0].tolist()


def prepare(cmd: dict) -> dict:
    case = dict(cmd, data=media_data(cmd["modality"], cmd["media"], cmd.get("metadata")))
    result: dict = {"ok": True, "variants": {}}
    for variant in STATE["procs"]:
        out = run_once(case, variant)
        arrays = tensors_of(out)
        np.savez(f"{cmd['save']}-{variant}.npz", **arrays)
        result["variants"][variant] = {
            "ids": list(out["prompt_token_ids"]),
            "shapes": {k: list(v.shape) for k, v in arrays.items()},
            "dtypes": {k: str(v.dtype) for k, v in arrays.items()}}
    STATE["cases"][cmd["id"]] = case
    try:
        result["ref_ids"] = reference(case)
    except Exception as exc:  # recorded; the timing still runs
        result["ref_error"] = f"{type(exc).__name__}: {exc}"
    return result


def time_case(cmd: dict) -> dict:
    case = STATE["cases"][cmd["id"]]
    times, cpu = [], []
    for _ in range(cmd["n"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        run_once(case, cmd["variant"])
        cpu.append(time.process_time() - start_cpu)
        times.append(time.perf_counter() - start)
    return {"ok": True, "times": times, "cpu": cpu}


def main() -> None:
    handlers = {"load": load, "case": prepare, "time": time_case}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            answer(handlers[cmd["cmd"]](cmd))
        except Exception as exc:  # the driver records it
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:]})


if __name__ == "__main__":
    main()
