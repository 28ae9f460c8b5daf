"""Our side of scripts/peer_vllm_processor.sh, and the driver of the comparison (project venv).

  media OUT/media        the media, generated deterministically as .npy files both venvs load
  run --out OUT ...      for each family: vLLM's worker (scripts/peer_vllm_processor_vllm.py,
                         a subprocess in vLLM's venv) and our Preprocessor (in this process)
                         on the same folder, prompt and media; warm-ups, then timed batches
                         interleaved vLLM, ours, vLLM, ours...; outputs compared (prompt ids
                         of both and of the HF processor called directly on the whole prompt,
                         tensors); cases where ours is slower are profiled (cProfile);
                         results.json and summary.md written to OUT.

Our stage timed: ``Preprocessor(loaded, ProcessorCache(0)).process(prompt, [MediaItem])``
(the processor per item + prompt assembly; no cache, no hashing); torch uses one thread.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_ARG = {"image": "images", "video": "videos", "audio": "audio"}
IMAGE_SIZES = ((256, 256), (1280, 720))  # W x H
VIDEO = (16, 320, 240)  # frames, W, H
AUDIO_SECONDS, AUDIO_RATE = 5, 16_000
VIDEO_FPS = 2.0  # the metadata of the 16 sampled frames (an 8 s clip, frames 0..15)


# --- media ------------------------------------------------------------------------------------
def make_media(out: Path) -> None:
    from aphrodite_cli.bench.harness import synthetic

    out.mkdir(parents=True, exist_ok=True)
    for w, h in IMAGE_SIZES:
        np.save(out / f"image-{w}x{h}.npy", synthetic.image_array(w, h, seed=0))
    frames, w, h = VIDEO
    np.save(out / f"video-{frames}x{w}x{h}.npy",
            np.stack([synthetic.video_frame(i, w, h) for i in range(frames)]))
    t = np.arange(AUDIO_SECONDS * AUDIO_RATE) / AUDIO_RATE
    wave = 0.4 * np.sin(2 * np.pi * (440 + 200 * t / AUDIO_SECONDS) * t)
    np.save(out / f"audio-{AUDIO_SECONDS}s.npy", wave.astype(np.float32))


def video_metadata() -> dict:
    frames, w, h = VIDEO
    return {"total_num_frames": frames, "fps": VIDEO_FPS, "frames_indices": list(range(frames)),
            "duration": frames / VIDEO_FPS, "width": w, "height": h, "video_backend": "pyav"}


def cases_for(spec, media: Path) -> list[dict]:
    cases = []
    for modality in spec.modalities:
        prompt = f"{spec.placeholders[modality]}\nDescribe this {modality}."
        if modality == "image":
            files = [(f"image {w}x{h}", media / f"image-{w}x{h}.npy") for w, h in IMAGE_SIZES]
        elif modality == "video":
            files = [("video {}x{}x{}".format(*VIDEO), media / "video-{}x{}x{}.npy".format(*VIDEO))]
        else:
            files = [(f"audio {AUDIO_SECONDS}s", media / f"audio-{AUDIO_SECONDS}s.npy")]
        for label, path in files:
            cases.append({"id": f"{spec.name}:{label}", "label": label, "modality": modality,
                          "prompt": prompt, "media": str(path),
                          # vLLM 0.32 needs every video's metadata (fps, sampled frames);
                          # ours reads it where the family writes timestamps
                          "metadata": video_metadata() if modality == "video" else None,
                          "timestamps": spec.video_timestamps})
    return cases


def decoded(case: dict):
    arr = np.load(case["media"])
    if case["modality"] == "image":
        from PIL import Image
        return Image.fromarray(arr)
    if case["modality"] == "audio":
        return (arr.astype(np.float32), AUDIO_RATE)
    return arr


# --- the two sides ----------------------------------------------------------------------------
class VllmWorker:
    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = open(log, "a")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM's worker exited (rc {self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self.log.close()


class Ours:
    def __init__(self, folder: str) -> None:
        from engine.config import PipelineConfig
        from engine.models.loader import load_model
        from engine.processing.pipeline import Pipeline

        self.loaded = load_model(folder)
        # as `aphrodite serve` runs it: no cache, the server's processor kwargs (for Qwen-VL
        # families --mm-device-do-normalize, on by default as in vLLM: uint8 pixels)
        pipeline = Pipeline(self.loaded, PipelineConfig(mm_processor_cache_gb=0))
        self.pre, self.kwargs = pipeline.preprocessor, pipeline.server_kwargs
        self.deferred = pipeline.device_normalize
        self.cases: dict[str, dict] = {}

    def classes(self) -> dict:
        hf = self.loaded.processor
        out = {"hf": type(hf).__name__}
        for attr in ("image_processor", "video_processor", "feature_extractor"):
            sub = getattr(hf, attr, None)
            if sub is not None:
                out[attr] = type(sub).__name__
        return out

    def run_once(self, case: dict):
        from engine.processing.preprocess import MediaItem

        item = MediaItem(case["modality"], decoded=case["data"],
                         metadata=case["metadata"])
        return self.pre.process(case["prompt"], [item], self.kwargs)

    def reference(self, case: dict) -> list[int]:
        data, extra = case["data"], {}
        if case["modality"] == "audio":
            data, extra["sampling_rate"] = data
        elif case["modality"] == "video" and case["timestamps"]:
            extra.update(do_sample_frames=False, video_metadata=[copy.deepcopy(case["metadata"])])
        out = self.loaded.processor(text=[case["prompt"]], **{_ARG[case["modality"]]: [data]},
                                    return_tensors="pt", **extra)
        return out["input_ids"][0].tolist()

    def prepare(self, case: dict, save: Path) -> dict:
        case = dict(case, data=decoded(case))
        out = self.run_once(case)
        self.cases[case["id"]] = case
        arrays = {k: (v.detach().float().numpy() if v.is_floating_point() else v.numpy())
                  for k, v in out.mm.items() if hasattr(v, "numpy")}
        np.savez(save, **arrays)
        result = {"ok": True, "ids": list(out.input_ids),
                  "shapes": {k: list(v.shape) for k, v in arrays.items()}}
        try:
            result["ref_ids"] = self.reference(case)
        except Exception as exc:
            result["ref_error"] = f"{type(exc).__name__}: {exc}"
        return result

    def time(self, case_id: str, n: int) -> tuple[list[float], list[float]]:
        """n calls: wall seconds, and CPU seconds of this process."""
        case = self.cases[case_id]
        times, cpu = [], []
        for _ in range(n):
            start, start_cpu = time.perf_counter(), time.process_time()
            self.run_once(case)
            cpu.append(time.process_time() - start_cpu)
            times.append(time.perf_counter() - start)
        return times, cpu

    def profile(self, case_id: str, n: int, out: Path) -> list[str]:
        case = self.cases[case_id]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            self.run_once(case)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
        out.write_text(text.getvalue())
        top = []
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:6]
        for (file, line, func), (_, _, tottime, _, _) in rows:
            top.append(f"{Path(file).name}:{line}({func}) {tottime / n * 1e3:.1f} ms/call")
        return top


# --- comparison ---------------------------------------------------------------------------------
def compare_tensors(a_file: Path, b_file: Path) -> dict:
    """vLLM's per-item tensors against ours (one item: equal but for a leading batch dim)."""
    a, b = np.load(a_file), np.load(b_file)
    out = {}
    for key in sorted(set(a.files) | set(b.files)):
        if key not in a.files or key not in b.files:
            out[key] = "only vLLM" if key in a.files else "only ours"
            continue
        x, y = a[key], b[key]
        if x.size != y.size:
            out[key] = f"size differs: vLLM {list(x.shape)} ours {list(y.shape)}"
        else:
            diff = float(np.abs(x.astype(np.float64).ravel() - y.astype(np.float64).ravel()).max()
                         ) if x.size else 0.0
            out[key] = "identical" if diff == 0 else f"max abs diff {diff:.3g}"
    return out


def stats_ms(times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, int(np.ceil(0.9 * len(ms))) - 1)]
    return {"median": statistics.median(ms), "p90": p90, "n": len(ms), "all": ms}


def run(args) -> None:
    import torch

    torch.set_num_threads(1)
    import transformers

    from engine.models.registry import REGISTRY

    out = Path(args.out)
    (out / "tensors").mkdir(parents=True, exist_ok=True)
    media = out / "media"
    worker = VllmWorker(json.loads(args.vllm_cmd), out / "vllm-worker.log")
    results = {"settings": {"warmups": args.warmups, "rounds": args.rounds, "batch": args.batch,
                            "torch_threads": 1, "media": {
                                "images": [f"{w}x{h}" for w, h in IMAGE_SIZES],
                                "video": "{} frames {}x{}".format(*VIDEO),
                                "audio": f"{AUDIO_SECONDS} s at {AUDIO_RATE} Hz"}},
               "versions": {"ours": {"transformers": transformers.__version__,
                                     "torch": torch.__version__}},
               "families": {}}
    families = args.families.split(",") if args.families else list(REGISTRY)
    try:
        for family in families:
            spec = REGISTRY[family]
            folder = str(Path(args.models) / family)
            fam = results["families"][family] = {"folder": folder, "cases": {}}
            print(f"== {family}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            ours = Ours(folder)
            fam["ours_classes"] = ours.classes()
            fam["ours_load_s"] = time.perf_counter() - start
            # vLLM: all the family's modalities; where that fails, each modality alone
            supported = list(spec.modalities)
            start = time.perf_counter()
            loaded = worker.call(cmd="load", folder=folder, limits={m: 1 for m in supported})
            if not loaded["ok"] and len(supported) > 1:
                fam["vllm_load_error_all_modalities"] = loaded["error"]
                for m in spec.modalities:
                    trial = worker.call(cmd="load", folder=folder, limits={m: 1})
                    if trial["ok"]:
                        loaded = trial
                        supported = [m]
                        break
            fam["vllm_load_s"] = time.perf_counter() - start
            if not loaded["ok"]:
                fam["vllm_error"] = loaded["error"]
                fam["vllm_traceback"] = loaded.get("traceback")
                print(f"   vLLM cannot load: {loaded['error']}", file=sys.stderr, flush=True)
                supported = []
            else:
                fam["vllm_classes"] = loaded["classes"]
                fam["vllm_mm_device_do_normalize"] = loaded["mm_device_do_normalize"]
                results["versions"]["vllm"] = loaded["versions"]
            fam["ours_mm_device_do_normalize"] = ours.deferred
            for case in cases_for(spec, media):
                res = fam["cases"][case["label"]] = {"prompt": case["prompt"]}
                cid = case["id"]
                safe = cid.replace(":", "-").replace(" ", "-")
                o = ours.prepare(case, out / "tensors" / f"{safe}-ours.npz")
                res["ours"] = {"tokens": len(o["ids"]), "shapes": o["shapes"]}
                res["ref"] = ({"tokens": len(o["ref_ids"])} if "ref_ids" in o
                              else {"error": o["ref_error"]})
                res["ours_matches_ref"] = o.get("ref_ids") == o["ids"]
                v = None
                if case["modality"] in supported:
                    v = worker.call(cmd="case", **case, save=str(out / "tensors" / f"{safe}-vllm"))
                    if not v["ok"]:
                        res["vllm_error"] = v["error"]
                        res["vllm_traceback"] = v.get("traceback")
                        v = None
                elif not fam.get("vllm_error"):
                    res["vllm_error"] = f"vLLM's processor takes no {case['modality']} here: " + \
                        fam.get("vllm_load_error_all_modalities", "")
                variants = list(v["variants"]) if v is not None else []
                if v is not None:
                    res["vllm_ref_vllm_venv_tokens"] = len(v.get("ref_ids") or [])
                    res["ref_venvs_agree"] = v.get("ref_ids") == o.get("ref_ids")
                    if "ref_error" in v:
                        res["vllm_venv_ref_error"] = v["ref_error"]
                    res["vllm"] = {}
                    for name, var in v["variants"].items():
                        r = res["vllm"][name] = {"tokens": len(var["ids"]), "shapes": var["shapes"],
                                                 "dtypes": var["dtypes"]}
                        r["ids_identical"] = var["ids"] == o["ids"]
                        r["matches_ref"] = o.get("ref_ids") == var["ids"]
                        r["matches_ref_vllm_venv"] = v.get("ref_ids") == var["ids"]
                        r["tensors"] = compare_tensors(
                            out / "tensors" / f"{safe}-vllm-{name}.npz",
                            out / "tensors" / f"{safe}-ours.npz")
                        if not r["ids_identical"]:
                            pairs = enumerate(zip(var["ids"], o["ids"], strict=False))
                            first = next((i for i, (x, y) in pairs if x != y),
                                         min(len(var["ids"]), len(o["ids"])))
                            tok = ours.loaded.tokenizer
                            r["first_difference"] = {
                                "at": first,
                                "vllm": tok.decode(var["ids"][max(0, first - 3):first + 12]),
                                "ours": tok.decode(o["ids"][max(0, first - 3):first + 12])}
                # warm-ups, then rounds of batches: vLLM (each variant), ours, vLLM, ours...
                wall: dict[str, list[float]] = {name: [] for name in [*variants, "ours"]}
                cpu: dict[str, list[float]] = {name: [] for name in [*variants, "ours"]}
                for name in variants:
                    worker.call(cmd="time", id=cid, variant=name, n=args.warmups)
                ours.time(cid, args.warmups)
                for _ in range(args.rounds):
                    for name in variants:
                        got = worker.call(cmd="time", id=cid, variant=name, n=args.batch)
                        wall[name] += got["times"]
                        cpu[name] += got["cpu"]
                    w, c = ours.time(cid, args.batch)
                    wall["ours"] += w
                    cpu["ours"] += c
                res["ours_ms"] = stats_ms(wall["ours"])
                res["ours_cpu_ms"] = stats_ms(cpu["ours"])
                for name in variants:
                    r = res["vllm"][name]
                    r["ms"] = stats_ms(wall[name])
                    r["cpu_ms"] = stats_ms(cpu[name])
                    r["ratio"] = res["ours_ms"]["median"] / r["ms"]["median"]
                    r["cpu_ratio"] = res["ours_cpu_ms"]["median"] / r["cpu_ms"]["median"]
                if variants and max(res["vllm"][n]["cpu_ratio"] for n in variants) > 1.0:
                    res["ours_profile_top"] = ours.profile(cid, max(5, args.batch),
                                                           out / f"profile-{safe}.txt")
                msg = " ".join(f"vLLM[{n}] {res['vllm'][n]['cpu_ms']['median']:.1f}"
                               for n in variants)
                print(f"   {case['label']}: CPU ms {msg or 'vLLM fails'} ours "
                      f"{res['ours_cpu_ms']['median']:.1f}; ids identical "
                      f"{[res['vllm'][n]['ids_identical'] for n in variants]}",
                      file=sys.stderr, flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    except Exception:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        traceback.print_exc()
        raise
    finally:
        worker.close()
    (out / "summary.md").write_text(summary(results))


def yn(value) -> str:
    return "-" if value is None else "yes" if value else "no"


def summary(results: dict) -> str:
    s = results["settings"]
    ver = results["versions"]
    vv = ver.get("vllm", {})
    lines = [
        "# Processor stage: vLLM vs ours (HF processor + prompt expansion, no model)",
        "",
        f"vLLM {vv.get('vllm', '?')} (transformers {vv.get('transformers', '?')}, torch "
        f"{vv.get('torch', '?')}) vs ours (transformers {ver['ours']['transformers']}, torch "
        f"{ver['ours']['torch']}); 1 torch thread each; {s['warmups']} warm-ups, then "
        f"{s['rounds']} rounds of {s['batch']} calls per side, interleaved. Times per call, ms: "
        "wall median (p90) / CPU median (the process's CPU time: steadier than wall time on a "
        "busy machine). Ratios: ours/vLLM of the CPU medians (of the wall medians).",
        "",
        "- vLLM: tokenize + parse_mm_data + processor.apply (processor cache off, request-id "
        "UUIDs: no hashing). Ours: the server's pipeline without its cache "
        "(Pipeline(loaded, PipelineConfig(mm_processor_cache_gb=0)).preprocessor.process with "
        "the server's processor kwargs).",
        "- vLLM host-norm: the same with mm_device_do_normalize=False. Both sides' default for "
        "Qwen2/2.5/3-VL defers rescale + normalize to the model on the device (the processor "
        "returns uint8 pixels): ours/vLLM compares the same work; host-norm is vLLM "
        "normalizing on the host.",
        "- ref: the HF processor called once on the whole prompt (our venv's transformers). "
        "vLLM = ref / ours = ref: the prompt ids equal ref's.",
        "- tensors: the vLLM variant doing ours' work (default where both defer, else "
        "host-norm) against ours.",
        "",
        "| family | media | vLLM ms | vLLM host-norm ms | ours ms | ours/vLLM | "
        "ours/host-norm | tokens vLLM / ours | ids identical | vLLM = ref / ours = ref | tensors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for family, fam in results["families"].items():
        for label, res in fam["cases"].items():
            oms = (f"{res['ours_ms']['median']:.1f} ({res['ours_ms']['p90']:.1f}) / "
                   f"{res['ours_cpu_ms']['median']:.1f}")
            vl = res.get("vllm", {})
            if not vl:
                err = fam.get("vllm_error") or res.get("vllm_error", "")
                notes.append(f"- {family} {label}: vLLM fails: `{err.strip()[:400]}`")
                lines.append(f"| {family} | {label} | fails | - | {oms} | - | - | - / "
                             f"{res['ours']['tokens']} | - | - / "
                             f"{yn(res.get('ours_matches_ref'))} | - |")
                continue

            def ms(name, vl=vl):
                r = vl.get(name)
                return "-" if r is None else (f"{r['ms']['median']:.1f} ({r['ms']['p90']:.1f}) / "
                                              f"{r['cpu_ms']['median']:.1f}")

            def ratio(name, vl=vl):
                return (f"{vl[name]['cpu_ratio']:.2f} ({vl[name]['ratio']:.2f})" if name in vl
                        else "-")

            d = vl["default"]
            # the variant doing the work ours does: deferred normalization (uint8) or not
            main = d if fam.get("ours_mm_device_do_normalize") else vl.get("host_norm", d)
            bad = {k: v for k, v in main["tensors"].items() if v != "identical"}
            tensors = "identical" if not bad else "; ".join(f"{k}: {v}" for k, v in bad.items())
            ident = yn(all(r["ids_identical"] for r in vl.values()))
            lines.append(
                f"| {family} | {label} | {ms('default')} | {ms('host_norm')} | {oms} | "
                f"{ratio('default')} | {ratio('host_norm')} | {d['tokens']} / "
                f"{res['ours']['tokens']} | {ident} | {yn(d['matches_ref'])} / "
                f"{yn(res.get('ours_matches_ref'))} | {tensors} |")
            for name, r in vl.items():
                if r.get("first_difference"):
                    f = r["first_difference"]
                    notes.append(f"- {family} {label}: vLLM[{name}] ids differ from ours at "
                                 f"{f['at']}: vLLM `{f['vllm']!r}` ours `{f['ours']!r}`")
            if not res.get("ref_venvs_agree", True):
                notes.append(f"- {family} {label}: the direct HF call differs between the venvs "
                             f"(vLLM's transformers: {res.get('vllm_ref_vllm_venv_tokens')} "
                             f"tokens, ours: {res['ref'].get('tokens')})")
            if res.get("ours_profile_top"):
                notes.append(f"- {family} {label}: ours slower than a vLLM variant; cProfile "
                             "top (tottime per call): " + "; ".join(res["ours_profile_top"][:4]))
    lines += ["", "| family | vLLM processor, its HF processor (and image/video/audio) | ours |",
              "|---|---|---|"]
    for family, fam in results["families"].items():
        vc, oc = fam.get("vllm_classes"), fam.get("ours_classes", {})
        vtxt = ", ".join(vc.values()) if vc else "fails: " + fam.get("vllm_error", "?")[:120]
        lines.append(f"| {family} | {vtxt} | {', '.join(oc.values())} |")
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("media")
    m.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--models", required=True, help="folder with one tiny model per family")
    r.add_argument("--vllm-cmd", required=True, help="JSON list: the vLLM worker's command")
    r.add_argument("--families", default="", help="comma-separated; default: all registered")
    r.add_argument("--warmups", type=int, default=3)
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--batch", type=int, default=2)
    s = sub.add_parser("summary", help="rewrite summary.md from results.json")
    s.add_argument("out")
    args = parser.parse_args()
    if args.cmd == "media":
        make_media(Path(args.out))
    elif args.cmd == "run":
        run(args)
    else:
        out = Path(args.out)
        (out / "summary.md").write_text(summary(json.loads((out / "results.json").read_text())))


if __name__ == "__main__":
    main()
