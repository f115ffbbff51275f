"""Mutation smoke check: make one small deliberate bug at a time in a copy of ``trt_sora/`` and run
the tests that claim to guard that behaviour; each bug must make them fail.

    python tests/mutations.py             # every mutation, one pytest per CPU at a time
    python tests/mutations.py --fast      # the ones whose tests need no run folder (what `make test` runs)
    python tests/mutations.py --jobs 1    # one at a time
    python tests/mutations.py --only gate-max-abs --only manifest-sha256
    python tests/mutations.py --list

A mutation is a literal ``old -> new`` replacement that must match exactly once in its file: when a
refactor moves the code, the mutation reports ``stale`` (and fails the run) instead of passing
silently. The copy is put first on ``PYTHONPATH``, so the tests import it, not the checkout (each run
checks that). Tests that start ``python -m trt_sora`` themselves point it at the checkout, so the
guarding tests listed here run in-process. With ``--jobs N`` (default: the CPU count) N mutations run at once,
each in its own copy of the package. Each mutation's pytest is a ``python -c`` forked by ``tests/prefork.py`` from
a server that imported torch, pytest and the other heavy third-party modules once (``trt_sora`` is never
imported there), so a mutation pays for its tests, not for those imports. Exit status: 0 when every mutation
is caught.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import prefork  # tests/, this script's folder

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    guards: str  # the behaviour the tests claim to guard
    file: str  # relative to trt_sora/
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the checkout
    fast: bool = False  # the tests need no run folder (export, calibration, check)


#: The Triton kernels' interpreter tests: Triton must be imported with TRITON_INTERPRET=1, and the forkserver
#: has imported it already (torch and diffusers do). A mutation guarded by tests of this file alone (node ids:
#: the tests that exercise the mutated kernel) runs them in a fresh process with the interpreter on, stopping at
#: the first failed test (not through the file's runner test, which starts that process itself and runs every
#: kernel to the end); the baseline runs them the same way (without the interpreter they skip themselves).
INTERPRETED = "tests/kernels/test_triton_interpret.py"
#: The prefix of their node ids.
_INTERP = INTERPRETED + "::"

MUTATIONS = (
    # -- observers ---------------------------------------------------------------------------------------------
    Mutation("observer-minmax-forgets", "MinMax keeps the running max over batches", "calibrate/observers.py",
             "            self.max_val = torch.maximum(self.max_val, mx)", "            self.max_val = mx",
             ("tests/calibrate/test_observers.py::test_minmax_equals_torch_ao",), fast=True),
    Mutation("observer-ema-weight", "EMA moves by averaging_constant toward each batch", "calibrate/observers.py",
             "            s = s + c * (b - s)", "            s = s + (1 - c) * (b - s)",
             ("tests/calibrate/test_observers.py::test_ema_amax_track_equals_float64_reference",), fast=True),
    Mutation("observer-percentile-rank", "percentile amax at the requested rank", "calibrate/observers.py",
             "    rank = (n - 1) * percentile / 100.0", "    rank = (n - 1) * (100.0 - percentile) / 100.0",
             ("tests/calibrate/test_observers.py::test_percentile_within_one_bin_of_numpy",), fast=True),
    Mutation("materialize-order", "parallel materialize gives each parameter its own tensor", "weights/sources.py",
             "zip(todo, pool.map(value, todo))", "zip(todo[::-1], pool.map(value, todo))",
             ("tests/weights/test_weights.py::test_empty_model_and_source_equal_load",), fast=True),
    # -- scale math --------------------------------------------------------------------------------------------
    Mutation("scale-qmax", "Q/DQ scale = amax / qmax of the format", "calibrate/fake_quant.py",
             "    s = a / qmax(fmt)", "    s = a / 127.0",
             ("tests/calibrate/test_fake_quant.py::test_fp8_per_tensor_matches_onnxruntime",), fast=True),
    Mutation("scale-kernel-reference", "the kernels' FP8 scale = amax / 448", "kernels/reference.py",
             "    s = amax.float() / FP8_MAX", "    s = amax.float() / 224.0",
             ("tests/kernels/test_reference.py::test_quantize_matches_the_qdq_fake_quant_bit_for_bit",), fast=True),
    Mutation("kernel-layernorm", "the fused LayerNorm kernel normalizes by C", "kernels/triton_ops.py",
             "    rstd = tl.rsqrt(sq / C + eps)\n",
             "    rstd = tl.rsqrt(sq / (C + 1) + eps)\n",
             (_INTERP + "test_residual_norm_quant",), fast=True),
    Mutation("kernel-rms-chunk-mask", "the RMS pass reads Q's (K's) channels alone past a partial chunk",
             "kernels/triton_ops.py", "m = rm[:, None] & (c0 + cols < C)[None, :]", "m = rm[:, None]",
             (_INTERP + "test_qkv_epilogue_on_widths_not_a_multiple_of_the_rms_chunk",), fast=True),
    Mutation("kernel-norm-segment-mask", "the LayerNorm kernel's second segment stops at the row's end",
             "kernels/triton_ops.py", "        mb = cb < C\n", "        mb = cb < SEG_A + SEG_B\n",
             (_INTERP + "test_residual_norm_quant",), fast=True),
    Mutation("kernel-norm-second-segment-stats", "the LayerNorm statistics take the row's second segment",
             "kernels/triton_ops.py", "        sq += tl.sum(db * db)\n", "        sq += 0.0\n",
             (_INTERP + "test_residual_norm_quant",), fast=True),
    Mutation("kernel-per-token-modulation", "the fused kernels read each token's own AdaLN vectors",
             "kernels/triton_ops.py", "    vrow = b * VB + t * VS  #", "    vrow = b * VB  #",
             (_INTERP + "test_per_token_modulation_reads_each_rows_own_vectors",), fast=True),
    Mutation("sdpa-fp8-k-smoothing", "cuDNN's FP8 operands take K minus its per-channel mean", "kernels/reference.py",
             "    k = k.float() - k.float().mean(dim=2, keepdim=True)\n    scales", "    k = k.float()\n    scales",
             ("tests/kernels/test_cudnn_attention.py::test_operands_are_per_tensor_fp8_of_smoothed_k",), fast=True),
    Mutation("sdpa-fp8-p-quant", "the cuDNN emulation quantizes P to FP8 before P V", "kernels/reference.py",
             "    o = (quantize(p, 1 / FP8_MAX).float() @ v8.float()) * (v_descale / FP8_MAX)",
             "    o = (p @ v8.float()) * v_descale",
             ("tests/kernels/test_cudnn_attention.py::test_emulation_follows_the_cudnn_graph_step_by_step",),
             fast=True),
    Mutation("attention-kernel-select", "ops.self_attention runs the kernel it is asked for", "kernels/ops.py",
             '    if not fp8 or kernel == "cudnn-fp8":', "    if not fp8:",
             ("tests/kernels/test_cudnn_attention.py::test_self_attention_selects_the_kernel",), fast=True),
    Mutation("attention-kernel-recipe", "the recipe's attention kernel reaches the checked options",
             "config/recipe.py", "        return d | ({\"kernel\": self.attention_kernel.value}",
             "        return d | ({}",
             ("tests/runners/test_backend_registry.py::test_the_options_a_report_records_are_the_options_served",),
             fast=True),
    Mutation("cute-p-operand", "the CuTe kernel's P registers hold the keys V^T holds at their positions",
             "kernels/cute_attention.py", "    return k % 2, 4 * c + 2 * h + k // 2",
             "    return k % 2, 4 * c + h + 2 * (k // 2)",
             ("tests/kernels/test_cute_attention.py::test_every_p_register_holds_the_key_that_vt_holds_at_its_position",),
             fast=True),
    Mutation("cute-require-dsl", "int8-cute without the DSL is refused with the install command",
             "kernels/cute_attention.py", '    if importlib.util.find_spec("cutlass") is None:\n        raise',
             "    if False:\n        raise",
             ("tests/kernels/test_cute_attention.py::test_require_names_the_install_command_without_the_dsl",),
             fast=True),
    Mutation("attention-kernel-cute", "int8-cute computes the int8 recipe's math", "kernels/ops.py",
             '    if not fp8 or kernel == "cudnn-fp8":', '    if not fp8 or kernel != "int8":',
             ("tests/runtime/test_torch_fp8.py::test_int8_cute_kernel_is_the_int8_math_and_recorded",)),
    Mutation("attention-kernel-policy", "the runner gives every block its policy's attention kernel",
             "runners/fp8_runner.py", "            b.attention_kernel = self.attention.kernel",
             '            b.attention_kernel = "int8"',
             ("tests/runtime/test_torch_fp8.py::test_attention_kernel_is_chosen_by_the_policy_and_reported",)),
    # -- gates -------------------------------------------------------------------------------------------------
    Mutation("gate-max-abs", "a max_abs gate fails past its threshold", "parity/metrics.py",
             '    add("max_abs", metrics.get("max_abs"), gate.max_abs, "<=")',
             '    add("max_abs", metrics.get("max_abs"), gate.max_abs, ">=")',
             ("tests/parity/test_check.py::test_max_abs_and_max_rel_l2_gates_fail_past_their_threshold",), fast=True),
    Mutation("gate-max-rel-l2", "a max_rel_l2 gate is applied", "parity/metrics.py",
             '    add("rel_l2", metrics.get("rel_l2"), gate.max_rel_l2, "<=")', "    pass",
             ("tests/parity/test_check.py::test_max_abs_and_max_rel_l2_gates_fail_past_their_threshold",), fast=True),
    Mutation("gate-cosine", "a min_cosine gate fails below its threshold", "parity/metrics.py",
             '    add("cosine", metrics.get("cosine"), gate.min_cosine, ">=")',
             '    add("cosine", metrics.get("cosine"), gate.min_cosine, "<=")',
             ("tests/parity/test_check.py::test_quality_level_exempts_a_trajectory_call_only_on_its_measured_"
              "contribution",), fast=True),
    # -- manifests, requests, SM values ------------------------------------------------------------------------
    Mutation("manifest-sha256", "a file whose sha256 changed is refused", "manifest.py",
             "    if not sha256 or got != sha256:", "    if not sha256:",
             ("tests/test_manifest.py",), fast=True),
    Mutation("manifest-recorded-entry", "an ONNX's entry keeps its external data's recorded hashes", "manifest.py",
             '        entry["external_data"] = {"path": str(p.with_name(p.name + ".data").resolve()), **data}',
             "        pass", ("tests/test_manifest.py",), fast=True),
    Mutation("lazy-exports", "a stage package's public name is its module's object", "errors.py",
             "            return getattr(importlib.import_module(table[name]), name)",
             "            return importlib.import_module(table[name])",
             ("tests/test_light_import.py::test_lazy_packages_import_light_and_resolve_each_public_name",), fast=True),
    Mutation("cli-out-checked-first", "a stage command refuses a foreign --out before any work", "cli/common.py",
             "    check_out_dir(args.out)\n", "\n",
             ("tests/cli/test_common.py::test_stage_commands_refuse_a_foreign_out_folder_before_reading_the_recipe",),
             fast=True),
    Mutation("cli-flag-overrides", "a stage command's flags override its recipe section", "cli/common.py",
             "    given = {k: v for k, v in flags.items() if v is not None}", "    given = {}",
             ("tests/cli/test_common.py::test_flags_override_only_what_they_set_read_as_the_recipe_yaml",), fast=True),
    Mutation("request-empty-prompt", "an empty prompt is refused before any work", "runtime/generate.py",
             "        if not self.prompt.strip():", "        if False:",
             ("tests/runtime/test_requests.py",), fast=True),
    Mutation("mp4-drops-last-group", "the streaming MP4 writer encodes every group it was given", "runtime/video.py",
             "        self._queue.put(None)\n        self._thread.join()\n        try:",
             "        self._queue.queue.pop()\n        self._queue.put(None)\n"
             "        self._thread.join()\n        try:",
             ("tests/runtime/test_video.py::test_streamed_groups_decode_to_the_whole_clip_writer_bytes",), fast=True),
    Mutation("mp4-keeps-temp", "a failed MP4 leaves no temp file", "runtime/video.py",
             "        self._tmp.unlink(missing_ok=True)\n\n    def __enter__", "        pass\n\n    def __enter__",
             ("tests/runtime/test_video.py::test_an_error_in_the_block_or_in_ffmpeg_leaves_no_file",), fast=True),
    Mutation("uint8-half-up", "decoded frames round half to even, as numpy's rint", "runtime/generate.py",
             "    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)",
             "    x = ((x.float().clamp(-1, 1) + 1) * 127.5 + 0.5).floor().to(torch.uint8)",
             ("tests/runtime/test_video.py::test_frames_to_uint8_round_half_to_even_as_numpy",), fast=True),
    Mutation("mp4-after-decode", "an MP4 is encoded while its clip decodes", "runtime/generate.py",
             '    streamed = {i: p for i, p in enumerate(paths) if p.suffix.lower() == ".mp4"}', "    streamed = {}",
             ("tests/runtime/test_generate.py::test_an_mp4_is_encoded_while_its_clip_decodes",)),
    Mutation("resolve-twice", "run_to_files resolves (tokenises) each request once", "runtime/generate.py",
             "    counts = {i: resolved[i].size[0] for i in streamed}",
             "    counts = {i: gen.resolve(requests[i]).size[0] for i in streamed}",
             ("tests/runtime/test_generate.py::test_each_request_is_resolved_once_when_written_to_files",)),
    Mutation("serve-resolve-twice", "a server's batch runs its jobs' resolutions", "serve/scheduler.py",
             "            clips = self.generator.run_resolved([j.resolved for j in batch], cfg=self.config.cfg,",
             "            clips = self.generator.run([j.request for j in batch], cfg=self.config.cfg,",
             ("tests/serve/test_server.py::test_each_job_is_resolved_once",)),
    Mutation("batch-cap-volume", "a batch's memory cap scales per-clip bytes by latent volume", "serve/scheduler.py",
             "            ratio = _latent_volume(resolved) / self._warm_volume", "            ratio = 1.0",
             ("tests/serve/test_server.py::test_batch_cap_scales_the_per_clip_bytes_by_latent_volume",)),
    Mutation("warmup-resolve-each", "a server's warm-up resolves one request", "serve/scheduler.py",
             "            gen.run_resolved(rs, cfg=self.config.cfg, max_batch=n)  # first call",
             "            gen.run([x.request for x in rs], cfg=self.config.cfg, max_batch=n)  # first call",
             ("tests/serve/test_server.py::test_each_job_is_resolved_once",)),
    Mutation("batch-resolve-twice", "a batch runs (and gates) the resolution its driver made", "serve/batch.py",
             "    clips = generator.run_resolved(resolved, cfg=cfg, max_batch=len(resolved))",
             "    clips = generator.run([r.request for r in resolved], cfg=cfg, max_batch=len(resolved))",
             ("tests/serve/test_batch.py::test_each_job_is_resolved_once",)),
    Mutation("ray-resolve-twice", "a Ray worker runs the resolution its driver made", "serve/ray_fleet.py",
             "        clips, ref = run_group(self.generator, self.reference, resolved, self.cfg)",
             "        clips, ref = run_group(self.generator, self.reference,\n"
             "                               [self.generator.resolve(r.request) for r in resolved], self.cfg)",
             ("tests/serve/test_batch.py::test_a_ray_worker_runs_the_drivers_resolution",)),
    Mutation("sm-order", "compute capabilities order as numbers", "sm.py",
             "    return major * 10 + minor", "    return major + minor * 10",
             ("tests/test_sm.py",), fast=True),
    Mutation("safetensors-format", "a calibration file of another format is refused", "manifest.py",
             '        if meta.get("format") != fmt:', "        if False:",
             ("tests/test_manifest.py::test_read_safetensors_names_a_missing_file_and_another_format",
              "tests/test_caching.py::test_an_attention_mass_file_is_not_read_as_step_ratios"), fast=True),
    # -- family facts on the family ----------------------------------------------------------------------------
    Mutation("family-module-outside-models", "no code outside models/ imports a family's module",
             "runners/fp8_runner.py", "        from trt_sora.kernels.fp8_linear import Gemm",
             "        from trt_sora.models.wan_fp8 import Gemm",
             ("tests/test_family_facts.py::test_no_code_outside_models_names_a_family_module_or_path",), fast=True),
    Mutation("family-excludes-ignored", "the family's default exclusions keep its layers unquantized", "site_policy.py",
             "        for pat, why in family_excludes.items():", "        for pat, why in {}.items():",
             ("tests/calibrate/test_fakequant_model.py::test_policy_default_exclusions",), fast=True),
    Mutation("import-cycle", "no module imports one that imports it back, lazily or not", "calibrate/trajectories.py",
             "    return gaussian_noise((shape.batch,",
             "    from trt_sora.calibrate.run import ALL_METHODS  # noqa\n    return gaussian_noise((shape.batch,",
             ("tests/test_import_direction.py::test_no_import_cycles",), fast=True),
    Mutation("trace-key-names-only", "the shared trace's key holds what the graph depends on", "export/trace.py",
             "return hashlib.sha256(repr(parts).encode()).hexdigest()",
             "return hashlib.sha256(repr(parts[:2]).encode()).hexdigest()",
             ("tests/export/test_weightless.py::test_the_shared_trace_key_tells_graphs_apart",), fast=True),
    Mutation("trace-key-weights", "a loaded model's shared trace is reused only for the same weights",
             "export/trace.py", "    if weights:\n        h = hashlib.sha256()",
             "    if False:\n        h = hashlib.sha256()",
             ("tests/export/test_export.py::test_a_loaded_models_trace_key_hashes_its_weights",), fast=True),
    # -- need run folders (export + calibration + quantize [+ check]) ------------------------------------------
    Mutation("trace-shared-pristine", "the pair's shared trace is copied before the first export changes it",
             "export/trace.py", "traces[key] = _copy_model(program.model)", "traces[key] = program.model",
             ("tests/test_experts.py::test_the_pair_is_traced_once_and_each_expert_gets_its_own_bytes",)),
    Mutation("trace-copy-names", "a copied trace names the nodes it gains as the traced graph does",
             "export/trace.py", "    graph._name_authority = copy.deepcopy(model.graph._name_authority)", "    pass",
             ("tests/test_experts.py::test_the_pair_is_traced_once_and_each_expert_gets_its_own_bytes",)),
    Mutation("torch-fp8-gelu-scale", "GELU output quantized at the FFN-down input's scale", "models/wan_fp8.py",
             "        h = ops.gelu_quant(self.ff1(y), self.ff2.act_scale)",
             "        h = ops.gelu_quant(self.ff1(y), self.ff1.act_scale)",
             ("tests/runtime/test_torch_fp8.py::test_every_gemm_reads_its_input_at_the_plans_scale",)),
    Mutation("torch-fp8-i2v-image-kv-scale", "I2V image tokens quantized at their own K/V GEMM's scale",
             "models/wan_fp8.py",
             "self.kv_img(ops.quantize(img, self.kv_img.act_scale))",
             "self.kv_img(ops.quantize(img, self.kv2.act_scale))",
             ("tests/runtime/test_torch_fp8_wan_variants.py::test_cpu_blocks_match_the_fake_quant_runner"
              "[i2v-False]",)),
    Mutation("torch-fp8-i2v-image-kv-bf16", "I2V image K/V run as the planned FP8 GEMM", "models/wan_fp8.py",
             "                                      plan, counters)\n            self.register_buffer(\"nki\"",
             "                                      {}, counters)\n            self.register_buffer(\"nki\"",
             ("tests/runtime/test_torch_fp8_wan_variants.py::test_cpu_blocks_match_the_fake_quant_runner"
              "[i2v-False]",)),
    Mutation("torch-fp8-i2v-image-attention-dropped", "I2V cross-attention adds the image tokens' attention",
             "models/wan_fp8.py",
             "self.out2.act_scale, ctx2=image)", "self.out2.act_scale)",
             ("tests/runtime/test_torch_fp8_wan_variants.py::test_cpu_blocks_match_the_fake_quant_runner"
              "[i2v-False]",)),
    Mutation("torch-fp8-ti2v-one-timestep", "TI2V tokens modulated by their own frame's timestep", "models/wan_fp8.py",
             "        mod = self.table + temb.float()",
             "        mod = self.table + (temb[:, :1] if temb.dim() == 4 else temb).float()",
             ("tests/runtime/test_torch_fp8_wan_variants.py::test_ti2v_block_modulates_each_token_by_its_own_frame",)),
    Mutation("hunyuan-fp8-mask-dropped", "HunyuanVideo's BF16 joint attention masks padded keys",
             "models/hunyuan_fp8.py", "F.scaled_dot_product_attention(q, k, v, attn_mask=mask)",
             "F.scaled_dot_product_attention(q, k, v, attn_mask=None)",
             ("tests/models/test_hunyuan_fp8.py::test_8bit_attention_over_masked_keys_is_the_masked_bf16_attention",
              "tests/models/test_hunyuan_fp8.py::test_cpu_blocks_match_the_fake_quant_runner[False]")),
    Mutation("hunyuan-fp8-key-length", "HunyuanVideo's 8-bit attention ends at the valid keys",
             "models/hunyuan_fp8.py", "(n + n_valid[:, 0]).to(torch.int32)",
             "(n + keys.shape[1] + 0 * n_valid[:, 0]).to(torch.int32)",
             ("tests/models/test_hunyuan_fp8.py::test_cpu_blocks_match_the_fake_quant_runner[False]",
              "tests/models/test_hunyuan_fp8.py::test_padded_text_streams_give_the_unpadded_output")),
    Mutation("torch-fp8-maskless-kernel", "a kernel without key lengths runs calls with masked keys in BF16",
             "runners/fp8_runner.py", "masks_ok = not self.keys_padded or self.attention.kernel in KEY_LENGTH_KERNELS",
             "masks_ok = True",
             ("tests/models/test_hunyuan_fp8.py::test_a_kernel_without_key_lengths_runs_masked_calls_in_bf16",)),
    Mutation("hunyuan-fp8-context-back", "the 8-bit attention's context outputs go back to their tokens",
             "models/hunyuan_fp8.py", "out[:, n:] = out[:, n:].gather(1, _index(slot, out))",
             "out[:, n:] = out[:, n:].clone()",
             ("tests/models/test_hunyuan_fp8.py::test_8bit_attention_over_masked_keys_is_the_masked_bf16_attention",),
             fast=True),
    Mutation("attention-key-len-k-mean", "K smoothing's mean is over the valid keys only", "kernels/reference.py",
             "k_mean = torch.where(valid, k.float(), 0.0).sum(dim=2) / valid.sum(dim=2)",
             "k_mean = k.float().mean(dim=2)",
             ("tests/kernels/test_reference.py::test_padded_keys_never_change_the_valid_tokens",), fast=True),
    Mutation("attention-key-len-v-scale", "V's per-channel scale is over the valid keys only", "kernels/reference.py",
             "vs = dequant_scale(vz.abs().amax(dim=2))", "vs = dequant_scale(v.float().abs().amax(dim=2))",
             ("tests/kernels/test_reference.py::test_padded_keys_never_change_the_valid_tokens",), fast=True),
    Mutation("attention-key-len-mask", "keys past the key length get no weight", "kernels/reference.py",
             "logits = logits.masked_fill(~key_valid(key_len, s)[:, None, None, :]",
             "logits = logits.masked_fill(~key_valid(key_len + 64, s)[:, None, None, :]",
             ("tests/kernels/test_reference.py::test_fp8_attention_with_key_lengths_tracks_masked_fp32_attention",),
             fast=True),
    Mutation("kernel-key-len-ragged", "the 8-bit kernel masks the keys past the length in its last tile",
             "kernels/triton_ops.py", "nm = (n_full * BLOCK_N + offs_n) < kl", "nm = (n_full * BLOCK_N + offs_n) < S",
             (_INTERP + "test_attention_with_key_lengths_attends_the_valid_keys_only",), fast=True),
    Mutation("kernel-wide-tile-scales", "a 256-key tile scales each 128-key group by its own K scale",
             "kernels/triton_ops.py", "tl.minimum(t * (BLOCK_N // _SB) + tl.arange(0, BLOCK_N // _SB), nblk - 1)",
             "tl.minimum(t * (BLOCK_N // _SB) + 0 * tl.arange(0, BLOCK_N // _SB), nblk - 1)",
             (_INTERP + "test_wide_key_tiles_track_fp32_attention",), fast=True),
    Mutation("kernel-i8-scale", "the epilogue's Q and K blocks take max / 127 as their INT8 scale",
             "kernels/triton_ops.py", "    s = tl.max(tl.max(a, 1), 0) / 127.0",
             "    s = tl.max(tl.max(a, 1), 0) / 120.0",
             (_INTERP + "test_qkv_epilogue_bf16_and_8bit",), fast=True),
    Mutation("kernel-int8-rounding", "the epilogue rounds INT8 half away from zero", "kernels/triton_ops.py",
             "    y = y + tl.where(y >= 0, 0.5, -0.5)", "    y = y + 0.5",
             (_INTERP + "test_qkv_epilogue_rounds_int8_half_away_from_zero",), fast=True),
    Mutation("kernel-key-len-k-mean", "the epilogue's K sums leave out the padded keys", "kernels/triton_ops.py",
             "tl.store(KSUM + part, tl.sum(tl.where(km, k, 0.0), 0))",
             "tl.store(KSUM + part, tl.sum(tl.where(rm[:, None], k, 0.0), 0))",
             (_INTERP + "test_attention_with_key_lengths_attends_the_valid_keys_only",), fast=True),
    Mutation("hunyuan-image-keys", "HunyuanVideo's image tokens are masked keys without an image", "models/hunyuan.py",
             "        return has_image and all(", "        return all(",
             ("tests/models/test_hunyuan_fp8.py::test_keys_are_all_valid_only_without_any_mask",), fast=True),
    Mutation("hunyuan-fp8-modulation", "the AdaLN shift and scale of the attention input in diffusers' order",
             "models/hunyuan_fp8.py", "_, y = ops.residual_norm_quant(x, mod_scale=m[1], mod_shift=m[0],",
             "_, y = ops.residual_norm_quant(x, mod_scale=m[0], mod_shift=m[1],",
             ("tests/models/test_hunyuan_fp8.py::test_cpu_blocks_match_the_fake_quant_runner",)),
    Mutation("hunyuan-fp8-text-qk-norm", "the text stream's Q is normed with its own weights",
             "models/hunyuan_fp8.py", "_qk_norm(eq, self.nq_c, h, eps)", "_qk_norm(eq, self.nq, h, eps)",
             ("tests/models/test_hunyuan_fp8.py::test_cpu_blocks_match_the_fake_quant_runner",)),
    Mutation("hunyuan-fp8-gelu-scale", "HunyuanVideo's GELU output quantized at the FFN-down input's scale",
             "models/hunyuan_fp8.py", "h = ops.gelu_quant(ff1(y), ff2.act_scale)",
             "h = ops.gelu_quant(ff1(y), ff1.act_scale)",
             ("tests/models/test_hunyuan_fp8.py::test_cpu_blocks_match_the_fake_quant_runner",)),
    Mutation("hunyuan-fp8-dead-text", "the last block computes no text stream (no GEMM the Q/DQ graph lacks)",
             "models/hunyuan_fp8.py", "text_out=i < len(blocks) - 1)", "text_out=True)",
             ("tests/models/test_hunyuan_fp8.py::test_every_planned_gemm_runs_once_in_fp8",)),
    Mutation("hunyuan-fp8-attention-renorm", "8-bit attention reads the per-head normed Q/K as they are",
             "models/hunyuan_fp8.py", "fp8=True, rstd=ones,", "fp8=True,",
             ("tests/models/test_hunyuan_fp8.py::test_8bit_attention_reads_the_normed_qk_as_they_are",), fast=True),
    Mutation("hunyuan-fp8-outside-blocks", "planned linears outside HunyuanVideo's blocks run in FP8",
             "models/hunyuan_fp8.py", "    swap_linears(model, plan, counters)\n", "",
             ("tests/models/test_hunyuan_fp8.py::test_planned_linears_outside_the_blocks_run_in_fp8",)),
    Mutation("quantize-shared-amax", "a shared input takes its members' largest amax", "quantize/api.py",
             "        amax = max(plan.act_amax[s] for s in sites)", "        amax = plan.act_amax[sites[0]]",
             ("tests/quantize/test_quantize.py::test_shared_input_takes_the_largest_members_amax",)),
    Mutation("quantize-site-dropped", "every quantized linear gets its Q/DQ", "quantize/api.py",
             "    quantized = list(plan.quantized)",
             "    quantized = list(plan.quantized)[1:]",
             ("tests/quantize/test_quantize.py::test_structure",)),
    Mutation("ort-qdq-fusions-on", "ONNX Runtime runs our Q/DQ as written, fusing none away", "onnx_tools.py",
             'ORT_DISABLED_OPTIMIZERS = ("QDQSelectorActionTransformer",)', "ORT_DISABLED_OPTIMIZERS = ()",
             ("tests/quantize/test_quantize.py::test_onnx_runtime_runs_our_qdq_as_written",)),
    Mutation("quantize-plan-fused-sites", "the plan lists the graph's sites after QKV fusion",
             "quantize/plan.py",
             "    sites = [s for s in linears if s not in {m for _, members in fused for m in members}]",
             "    sites = list(linears)",
             ("tests/quantize/test_site_plan.py::test_plan_lists_the_sites_wan_tiny_quantizes",)),
    Mutation("build-profile-min", "each profile spans the bucket's min, opt and max", "build/builder.py",
             'tuple(_shape(spec, bucket.point(w)) for w in ("min", "opt", "max"))',
             'tuple(_shape(spec, bucket.point(w)) for w in ("opt", "opt", "max"))',
             ("tests/build/test_build_plan.py::test_one_engine_with_a_profile_per_bucket",), fast=True),
    Mutation("batch-resume-sha256", "resume re-checks a finished clip's sha256", "serve/batch.py",
             '            if not p.is_file() or p.stat().st_size != o["bytes"] or sha256_file(p) != o["sha256"]:',
             '            if not p.is_file() or p.stat().st_size != o["bytes"]:',
             ("tests/serve/test_batch.py::test_resume_rechecks_finished_clips",)),
    Mutation("batch-resume-failed", "resume retries failed jobs", "serve/batch.py",
             'rec.get("status") not in (DONE, GATE_FAILED)', 'rec.get("status") not in (DONE, GATE_FAILED, FAILED)',
             ("tests/serve/test_batch.py::test_resume_retries_failed_jobs",)),
    Mutation("runtime-sha256", "the runtime re-hashes every checked file", "runtime/verify.py",
             "    if rep is None or get_backend(backend).checked_as is None:", "    if True:",
             ("tests/runtime/test_runtime.py::test_refuses_a_checked_file_changed_after_the_check",)),
    Mutation("served-options", "the runtime opens a backend with the options its check recorded",
             "runners/registry.py", '        checked = {k: cand["open"][k] for k in CHECKED if k in cand["open"]}',
             "        checked = {}",
             ("tests/runners/test_backend_registry.py::"
              "test_the_options_a_report_records_are_the_options_served",), fast=True),
    Mutation("runtime-failed-gate", "the runtime refuses an artifact that failed its gates", "runtime/verify.py",
             '    if not rep.get("passed"):\n        return f"failed its parity gates',
             '    if False:\n        return f"',
             ("tests/runtime/test_runtime.py::test_refuses_unchecked_and_failed",)),
    Mutation("batch-id-check", "a job id cannot name a path outside the output folder", "serve/batch.py",
             "    if _ID.fullmatch(jid):", "    if True:",
             ("tests/serve/test_batch.py::test_bad_ids_are_refused_before_anything_is_written",)),
    Mutation("batch-write-containment", "every batch write stays under --out", "serve/batch.py",
             "        if not real.is_relative_to(self._real):", "        if False:",
             ("tests/serve/test_batch.py::test_writes_stay_in_the_output_folder_without_the_id_check",)),
    Mutation("fmp4-nal-cut", "an mdat larger than a piece is cut where NAL units begin", "serve/fmp4.py",
             "        starts.append(at)\n", "        starts.append(at + 4)\n",
             ("tests/serve/test_grpc.py::test_pieces_cut_large_boxes_at_nal_units",), fast=True),
    Mutation("fmp4-encoder-settings", "the gRPC stream's H.264 is the file path's", "serve/fmp4.py",
             "*x264_args(w, h, fps, crf, DEFAULT_PRESET)", "*x264_args(w, h, fps, int(crf) + 1, DEFAULT_PRESET)",
             ("tests/serve/test_grpc.py::test_stream_is_progress_then_a_fragmented_mp4_equal_to_the_file_path",)),
    Mutation("streamed-decoder", "a family's one-shot decode is all its frame groups", "models/base.py",
             "torch.cat(list(groups(z)), dim=2)", "torch.cat(list(groups(z))[:1], dim=2)",
             ("tests/models/test_wan.py::test_frame_groups_are_the_one_shot_decode_bit_for_bit",
              "tests/models/test_hunyuan.py::test_frame_groups_are_the_one_shot_decode_within_its_rounding"),
             fast=True),
    Mutation("use-vae-ignored", "a VAE installed for a place is the one its decoders use", "models/base.py",
             "        self.__dict__[self._vae_key(device, dtype)] = (vae, description)", "        pass",
             ("tests/models/test_use_vae.py",), fast=True),
    Mutation("wan-causal-decode", "Wan's frame groups are the one-shot VAE decode", "models/wan.py",
             "first_chunk=i == 0)", "first_chunk=False)",
             ("tests/models/test_wan.py::test_frame_groups_are_the_one_shot_decode_bit_for_bit",), fast=True),
    Mutation("hunyuan-causal-decode", "HunyuanVideo's frame groups carry the frames before them",
             "models/hunyuan.py", "    prev = seen.get(id(conv))\n", "    prev = None\n",
             ("tests/models/test_hunyuan.py::test_frame_groups_are_the_one_shot_decode_within_its_rounding",),
             fast=True),
    Mutation("hunyuan-causal-first-frame", "only a HunyuanVideo clip's first frame stays one frame",
             "models/hunyuan.py", "first=i == 0)", "first=i == 1)",
             ("tests/models/test_hunyuan.py::test_frame_groups_are_the_one_shot_decode_within_its_rounding",),
             fast=True),
    Mutation("serve-cancel-step", "a cancelled running job stops at its next step", "serve/scheduler.py",
             "            raise _Cancelled()\n", "            pass\n",
             ("tests/serve/test_grpc.py::test_a_client_that_cancels_cancels_its_job",)),
    Mutation("serve-cancel-no-steps", "a job cancelled in a shared batch is sent no more steps",
             "serve/scheduler.py", "if j.on_step is not None and not j.cancel_event.is_set():",
             "if j.on_step is not None:", ("tests/serve/test_grpc.py::"
              "test_a_client_that_cancels_in_a_shared_batch_leaves_the_others_unchanged",)),
    Mutation("serve-cancel-no-frames", "a job cancelled in a shared batch is sent no frames",
             "serve/scheduler.py", "if job.on_frames is not None and not job.cancel_event.is_set():",
             "if job.on_frames is not None:", ("tests/serve/test_grpc.py::"
              "test_a_client_that_cancels_in_a_shared_batch_leaves_the_others_unchanged",)),
    Mutation("serve-cancel-no-decode", "a job cancelled in a shared batch costs no decode", "serve/scheduler.py",
             "wanted=lambda i: not batch[i].cancel_event.is_set())", "wanted=lambda i: True)",
             ("tests/serve/test_server.py::test_a_cancelled_job_of_a_shared_batch_is_not_decoded",)),
    Mutation("serve-warmup-known-prompt", "a server of an embeddings file warms up on one of its captions",
             "runtime/generate.py", 'return next(iter(known)) if known else "warm-up"', 'return "warm-up"',
             ("tests/serve/test_server.py::test_a_server_of_a_text_embeddings_file_warms_up_on_its_captions",)),
    Mutation("http-leave-cancels", "a client that leaves POST /v1/generate cancels its job", "serve/server.py",
             "            jobs.engine.cancel(job.id)\n", "            pass\n",
             ("tests/serve/test_server.py::test_a_client_that_leaves_generate_cancels_its_job_alone",)),
    Mutation("grpc-auth", "gRPC streams need a key of --api-keys-file", "serve/grpc_server.py",
             "        if self.keys is not None:\n", "        if False:\n",
             ("tests/serve/test_grpc.py::test_keys_are_required",)),
    Mutation("batch-vmaf-bar", "a clip under --vmaf-threshold fails its gate", "serve/batch.py",
             '    if bar["min_vmaf"] is not None and not (isinstance(scores["vmaf"], float) and scores["vmaf"] >= '
             'bar["min_vmaf"]):', "    if False:",
             ("tests/serve/test_batch.py::test_psnr_and_vmaf_thresholds_fail_the_clip_and_the_command",)),
    Mutation("batch-psnr-bar-edge", "a worst-frame PSNR equal to its bar passes", "serve/batch.py",
             '    if not scores["worst_psnr_db"] >= bar["min_psnr_db"]:',
             '    if not scores["worst_psnr_db"] > bar["min_psnr_db"]:',
             ("tests/serve/test_batch.py::test_psnr_and_vmaf_thresholds_fail_the_clip_and_the_command",)),
    Mutation("vmaf-input-order", "VMAF scores the candidate against the reference, not the reverse",
             "serve/quality.py", "[0:v]{up}[d];[1:v]{up}[r];[d][r]libvmaf", "[0:v]{up}[r];[1:v]{up}[d];[d][r]libvmaf",
             ("tests/serve/test_batch.py::test_psnr_and_vmaf_thresholds_fail_the_clip_and_the_command",)),
    Mutation("batch-vmaf-precheck", "VMAF from an ffmpeg without libvmaf is refused before a model loads",
             "cli/batch.py", '        require_vmaf("--vmaf-threshold" if gate.min_vmaf is not None else "--vmaf")',
             "        pass",
             ("tests/serve/test_cli.py::test_batch_checks_quality_bars_and_libvmaf_before_the_model_loads",),
             fast=True),
    Mutation("request-guidance-bound", "a non-finite or huge guidance is refused before work", "runtime/generate.py",
             "not math.isfinite(v) or not lo <= v <= hi", "not math.isfinite(v)",
             ("tests/serve/test_batch.py::test_bad_requests_are_recorded_failed_in_the_output_folder",)),
    Mutation("serve-body-limit", "a body streaming past --max-body-bytes gets 413", "serve/server.py",
             "                    if size > max_body_bytes:", "                    if False:",
             ("tests/serve/test_hostile.py::test_a_chunked_body_is_cut_off_at_the_limit",), fast=True),
    Mutation("serve-json-check", "deep nesting and lone surrogates get 400 before any work", "serve/server.py",
             "        _check_json(body)", "        pass",
             ("tests/serve/test_hostile.py::test_bad_bodies_are_refused_before_any_work",), fast=True),
    Mutation("serve-wait-budget", "the batcher waits its budget for compatible jobs", "serve/scheduler.py",
             "                    if len(same) >= cap or wait <= 0 or self.draining:",
             "                    if len(same) >= cap or wait <= 2.0 or self.draining:",
             ("tests/serve/test_server.py::test_dynamic_batching_waits_for_compatible_jobs",)),
    Mutation("store-commit-before-202", "an accepted job is in the store before submit returns",
             "serve/scheduler.py", "                self.store.add(job.id, ",
             "                0 and self.store.add(job.id, ",
             ("tests/serve/test_store.py::test_an_accepted_job_is_in_the_store_before_submit_returns",)),
    Mutation("store-retention-count", "retention keeps exactly the --keep newest finished jobs", "serve/store.py",
             '"LIMIT -1 OFFSET ?", (keep,))]', '"LIMIT -1 OFFSET ?", (keep + 1,))]',
             ("tests/serve/test_store.py::test_retention_by_age_and_count_and_unreferenced_files",), fast=True),
    Mutation("auth-any-key", "only a key of the file is let in", "serve/auth.py",
             "            if hmac.compare_digest(d, digest) and found is None:", "            if found is None:",
             ("tests/serve/test_auth.py::test_keys_are_identified_by_id_never_by_a_prefix",), fast=True),
    Mutation("auth-own-jobs", "a key sees only its own jobs", "serve/server.py",
             "        if job is None or (self.keys is not None and job.key_id != _caller(request)):",
             "        if job is None:",
             ("tests/serve/test_auth.py::test_a_key_sees_its_own_jobs_within_its_quota",)),
    Mutation("serve-retry-after-rate", "Retry-After is one job's share of the measured drain time",
             "serve/scheduler.py",
             "        wait = (finishes[-1] - finishes[0]) / (len(finishes) - 1)",
             "        wait = (finishes[-1] - finishes[0]) / len(finishes)",
             ("tests/serve/test_hostile.py::test_retry_after_follows_the_measured_drain_rate",), fast=True),
    Mutation("prompt-length", "a prompt past the text dims is refused", "runtime/generate.py",
             "                if n <= limit:", "                if n <= limit + 1:",
             ("tests/runtime/test_generate.py::test_a_prompt_longer_than_the_text_dims_is_refused_or_cut_on_request",)),
    # -- step caching ------------------------------------------------------------------------------------------
    Mutation("cache-expert-switch", "a pair's expert switch forces a compute step", "caching.py",
             " or experts[i] != experts[i - 1]", "",
             ("tests/test_caching.py::test_expert_switch_forces_a_compute",), fast=True),
    Mutation("cache-stale-output", "a reused branch gets its last computed output", "sampling.py",
             "                    history[b] = [*history.get(b, [])[-1:], (float(t), out[b])]",
             "                    history.setdefault(b, [(float(t), out[b])])",
             ("tests/test_caching.py::test_sampler_reuses_exactly_the_scheduled_outputs",), fast=True),
    Mutation("cache-ratio-direction", "the magnitude ratio is this step's over the previous one", "caching.py",
             "rows[-1][:, step] = mag / prev[-1][3]", "rows[-1][:, step] = prev[-1][3] / mag",
             ("tests/test_caching.py::test_recorded_ratios_match_an_independent_computation",), fast=True),
    Mutation("cache-extrapolate-line", "a skipped step continues the line from the newest output", "caching.py",
             "line = y2 + (y2 - y1) * (damping * ((timestep - t2) / (t2 - t1)))",
             "line = y2 + (y2 - y1) * (damping * ((timestep - t1) / (t2 - t1)))",
             ("tests/test_caching.py::test_extrapolate_arithmetic",), fast=True),
    Mutation("cache-damping-ignored", "a damped schedule shrinks the line toward the newest output", "caching.py",
             "return extrapolate(history[branch], timestep, self.order, self.damping)",
             "return extrapolate(history[branch], timestep, self.order)",
             ("tests/test_caching.py::test_sampler_extrapolates_reused_outputs",), fast=True),
    Mutation("cache-extrapolate-parabola", "order 2 continues the parabola through the newest three outputs",
             "caching.py", "curvature * ((timestep - t2) * (timestep - t1) / (t2 - t0))",
             "curvature * ((timestep - t2) * (timestep - t0) / (t2 - t0))",
             ("tests/test_caching.py::test_extrapolate_order2_is_the_parabola",), fast=True),
    Mutation("cache-extrapolation-anchors", "the recorded error extrapolates from steps i-h-1 and i-h", "caching.py",
             "for s in (step - h - 1, step - h)", "for s in (step - h - 2, step - h)",
             ("tests/test_caching.py::test_recorded_ratios_match_an_independent_computation",), fast=True),
    Mutation("cache-shared-decision", "both branches' step decision follows the worse branch", "caching.py",
             "err += max(float(errors[b]", "err += min(float(errors[b]",
             ("tests/test_caching.py::test_extrapolated_schedule_on_hand_worked_errors",), fast=True),
    Mutation("cache-global-horizon", "plan: global counts a reused step's error at its place in its run",
             "caching.py", "cost + float(worst[i, run])", "cost + float(worst[i, 0])",
             ("tests/test_cache_plan.py::test_global_plan_on_hand_worked_errors",), fast=True),
    Mutation("cache-global-least", "plan: global keeps the least-error plan of each count", "caching.py",
             "if key not in nxt or plan[0] < nxt[key][0]:", "if key not in nxt:",
             ("tests/test_cache_plan.py::test_global_plan_on_hand_worked_errors",), fast=True),
    Mutation("cfg-delta-reset", "the CFG branch difference resets at a pair's expert switch", "sampling.py",
             "                history.pop(CFG_DELTA, None)  # the branch difference is the expert's own",
             "                pass",
             ("tests/test_cfg_reuse.py::test_pair_switch_resets_the_branch_difference",), fast=True),
    Mutation("cfg-plan-switch", "an expert's first step computes both branches under cfg_reuse", "caching.py",
             " or experts[i - 1] != experts[i]", "",
             ("tests/test_cfg_reuse.py::test_horizon_limit_and_the_pair_switch",), fast=True),
    Mutation("cfg-plan-budget", "cond-only runs sum their errors since the last step computing both", "caching.py",
             "err += float(errors[i, h - 1])\n            out.append(i)\n            alone = True",
             "err = float(errors[i, h - 1])\n            out.append(i)\n            alone = True",
             ("tests/test_cfg_reuse.py::test_cond_only_steps_on_hand_worked_errors",), fast=True),
    Mutation("cfg-estimate-cond", "uncond is this step's cond plus the branch difference", "caching.py",
             'return cond + extrapolate(history[CFG_DELTA]', 'return extrapolate(history[CFG_DELTA]',
             ("tests/test_cfg_reuse.py::test_estimate_is_cond_plus_the_continued_difference",
              "tests/test_cfg_reuse.py::test_sampler_calls_cond_alone_and_matches_the_loop_written_out"), fast=True),
    Mutation("cfg-whole-skip-cond", "a step skipped whole takes uncond from its cond estimate", "caching.py",
             'else extrapolate(history["cond"], timestep, self.order,\n'
             '                                                                      self.damping)',
             'else history["cond"][-1][1]',
             ("tests/test_cfg_reuse.py::test_sampler_calls_cond_alone_and_matches_the_loop_written_out",), fast=True),
    Mutation("cfg-recorded-error", "the recorded error compares the estimate with this step's difference",
             "caching.py", "diff = (extrapolate(history, t, o) - delta)",
             "diff = (extrapolate(history, t, o) - uncond)",
             ("tests/test_cfg_reuse.py::test_recorded_cfg_errors_match_an_independent_computation",), fast=True),
    Mutation("cfg-setting-record", "a setting with cfg_reuse on records its keys", "config/recipe.py",
             "return d if self.cfg_reuse else", "return d if False else",
             ("tests/test_cfg_reuse.py::test_recipes_and_records_without_cfg_reuse_are_unchanged",), fast=True),
    Mutation("cache-plan-record", "a setting with plan: runs records no plan key", "config/recipe.py",
             "        if self.plan is CachePlan.RUNS:", "        if False:",
             ("tests/test_cache_plan.py::test_recipes_and_records_without_plan_are_unchanged",), fast=True),
    Mutation("cache-check-gate", "a cached clip below the gates fails the check", "parity/caching.py",
             '"checks": checks, "passed": all(c["passed"] for c in checks)}', '"checks": checks, "passed": True}',
             ("tests/parity/test_caching_check.py::test_too_aggressive_threshold_fails_check",)),
    Mutation("cache-runtime-unchecked", "the runtime refuses a caching setting its check did not pass",
             "runtime/served_caching.py", '    if checked.get("setting") != wanted:', "    if False:",
             ("tests/parity/test_caching_check.py::test_runtime_refuses_an_unchecked_caching_setting",)),
    # -- sparse attention ------------------------------------------------------------------------------------
    Mutation("sparse-window-edge", "a key tile at exactly the window's distance is attended", "sparse.py",
             "tiles[None, :, :]) <= np.asarray(window)", "tiles[None, :, :]) < np.asarray(window)",
             ("tests/test_sparse.py::test_token_mask_matches_the_definition",), fast=True),
    Mutation("sparse-global-frames", "only the first global_frames frames are global keys", "sparse.py",
             "c[:, 0] < global_frames)", "c[:, 0] <= global_frames)",
             ("tests/test_sparse.py::test_token_mask_matches_the_definition",), fast=True),
    Mutation("sparse-mass-outside", "the measured mass is the mass outside the window", "sparse.py",
             "(p * ~m[s0:s0 + chunk])", "(p * m[s0:s0 + chunk])",
             ("tests/test_sparse.py::test_outside_mass_matches_a_direct_sum",), fast=True),
    Mutation("sparse-budget", "a layer takes the narrowest window within the mass budget", "sparse.py",
             "for c, m in zip(candidates, worst) if m <= budget)", "for c, m in zip(candidates, worst) if m >= budget)",
             ("tests/test_sparse.py::test_plan_picks_the_narrowest_window_within_the_budget",), fast=True),
    Mutation("sparse-calib-step", "the calibrated mass is recorded at the step of its call", "calibrate/run.py",
             "                                       call.step))", "                                       0))",
             ("tests/calibrate/test_run.py::test_attention_mass_is_measured_over_the_calibration_trajectories",)),
    Mutation("sparse-kernel-list", "the sparse kernel loads the listed key tiles", "kernels/triton_ops.py",
             "j = tl.load(KIDX + qb * KSTRIDE + jj)", "j = jj",
             (_INTERP + "test_block_sparse_attention_skips_exactly_the_masked_key_tiles",), fast=True),
    Mutation("sparse-kernel-ragged", "a ragged key tile outside the pattern adds nothing", "kernels/triton_ops.py",
             "nm = nm & (tl.load(KRAG + (pid_m * BLOCK_M) // BLOCK_N) != 0)", "nm = nm",
             (_INTERP + "test_block_sparse_attention_skips_exactly_the_masked_key_tiles",), fast=True),
    Mutation("sparse-fp8-rope-order", "the fused block's RoPE rows follow its tile order", "kernels/ops.py",
             "_rows(qkv, sparse.perm), cos[sparse.perm], sin[sparse.perm]", "_rows(qkv, sparse.perm), cos, sin",
             ("tests/test_sparse.py::test_fused_attention_in_tile_order_is_the_raster_masked_attention",), fast=True),
    Mutation("sparse-torch-runner", "the torch runner applies the plan on every call", "runners/torch_runner.py",
             "with torch.inference_mode(), self._sparse_call(inputs):", "with torch.inference_mode():",
             ("tests/parity/test_sparse_check.py::test_torch_and_torch_fp8_apply_the_same_mask",)),
    Mutation("sparse-check-gate", "a too-sparse candidate fails the clip's gates", "parity/check.py",
             "        options = dataclasses.replace(options, sparse=plan.sparse.plan.to_dict())",
             "        pass",
             ("tests/parity/test_sparse_check.py::test_a_too_sparse_setting_fails_its_gates",)),
    Mutation("serve-body-timeout", "a stalled body gets 408", "serve/server.py",
             "            with anyio.fail_after(body_timeout_s):", "            with anyio.fail_after(None):",
             ("tests/serve/test_hostile.py::test_a_stalled_body_gets_408_and_holds_nothing",)),
    Mutation("serve-client-gone", "a client that hangs up mid-body is counted as client_gone", "serve/server.py",
             'ClientGone: ("client_gone", 499)', 'ClientGone: ("body_timeout", 499)',
             ("tests/serve/test_hostile.py::test_a_client_that_hangs_up_mid_body_is_counted_not_crashed",),
             fast=True),
    # -- object storage (batch --out s3://) ------------------------------------------------------------------
    Mutation("s3-temp-key", "a clip object reaches its final key only through a checked temporary key",
             "serve/objstore.py",
             'tmp, final = self.key(*filter(None, (folder, f".{name}.tmp-{self.token}"))), self.key(rel)',
             'tmp = final = self.key(rel)',
             ("tests/serve/test_s3.py::test_objects_sha256_and_one_upload_per_file",
              "tests/serve/test_s3.py::test_serve_upload_cut_off_leaves_no_visible_object")),
    Mutation("s3-resume-sha256", "resume re-hashes a finished clip's objects in the bucket", "serve/objstore.py",
             'if self._sha256(k) != (o.get("sha256"), o.get("bytes")):', "if False:",
             ("tests/serve/test_s3.py::test_resume_rehashes_the_objects_in_the_bucket",)),
    Mutation("s3-key-containment", "a record cannot name an object outside the prefix", "serve/objstore.py",
             '        rel = _check_rel("/".join(parts), f"key under {self.root}")', '        rel = "/".join(parts)',
             ("tests/serve/test_s3.py::test_resume_rehashes_the_objects_in_the_bucket",)),
    Mutation("s3-orphan-temp-keys", "a rerun deletes the temporary keys of a cut-off upload", "serve/objstore.py",
             'n.split(".")[0] == jid or n.startswith(f".{jid}.")', 'n.split(".")[0] == jid',
             ("tests/serve/test_s3.py::test_server_killed_mid_upload_then_rerun_uploads_only_unfinished",)),
    Mutation("s3-bucket-check", "a missing bucket is refused before a model loads", "serve/objstore.py",
             '            self.fs.call_s3("head_bucket", Bucket=self.bucket)', "            pass",
             ("tests/serve/test_s3.py::test_errors_before_the_model_loads",), fast=True),
    # -- object storage (serve --results s3://) --------------------------------------------------------------
    Mutation("serve-s3-fetch-sha256", "a result fetched from the bucket is checked against its job's sha256",
             "serve/objstore.py", "        if sha256 is not None and got != sha256:", "        if False:",
             ("tests/serve/test_s3.py::test_serve_results_live_in_the_bucket_across_restarts_until_swept",)),
    Mutation("serve-s3-retention", "the retention sweep deletes the objects of the jobs it drops",
             "serve/scheduler.py", "            self.remote.prune(self.store.live_results())", "            pass",
             ("tests/serve/test_s3.py::test_serve_results_live_in_the_bucket_across_restarts_until_swept",)),
    Mutation("serve-s3-orphan-temp-keys", "the sweep deletes the temporary keys of cut-off uploads",
             "serve/objstore.py", '(n.startswith(".") and ".tmp-" in n and not n.endswith(self.out.token))',
             "False", ("tests/serve/test_s3.py::test_serve_upload_cut_off_leaves_no_visible_object",)),
)


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # caught / SURVIVED / STALE / ERROR
    seconds: float
    detail: str = ""


def _copy_package(dest: Path) -> Path:
    # symlinks followed: trt_sora/_recipes and _calib point at the checkout's recipes/ and calib/
    shutil.copytree(ROOT / "trt_sora", dest / "trt_sora", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _xdist(jobs: int) -> tuple[str, ...]:
    """pytest's options for ``jobs`` workers (each test file whole on one), none without xdist."""
    if jobs < 2 or importlib.util.find_spec("xdist") is None:
        return ()
    return "-n", str(jobs), "--dist", "loadfile"


def _env(src: Path) -> dict:
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


#: Where the test processes start: not the checkout's root, which Python would put first on sys.path
#: (``-c`` / ``-m`` prepend the working folder) and so import the unmutated package from.
CWD = ROOT / "tests"


def _check_import_path(src: Path) -> None:
    """The tests must import the copy: a setuptools editable finder or a stray install would hide it."""
    got = subprocess.run([sys.executable, "-c", "import trt_sora; print(trt_sora.__file__)"], env=_env(src),
                         cwd=CWD, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(got).resolve().is_relative_to(src.resolve()):
        sys.exit(f"mutations: trt_sora imports from {got}, not from the mutated copy in {src}")


#: The line that ends a pytest process's stdout, before pytest's exit status.
_STATUS = "pytest exit status "
#: What each pytest process runs (``python -c``; argv: the copy's folder, then pytest's arguments): ``trt_sora``
#: from the copy, or exit 1 naming where it came from; then pytest, whose exit status is its last line on stdout
#: (a process that dies before pytest returns prints none: its exit status 1 is no failed test).
_PYTEST = f"""
import sys
from pathlib import Path

import trt_sora

if not Path(trt_sora.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()):
    sys.exit(f"trt_sora imports from {{trt_sora.__file__}}, not from the mutated copy in {{sys.argv[1]}}")
import pytest

rc = int(pytest.main(sys.argv[2:]))
print({_STATUS!r} + str(rc), flush=True)
sys.exit(rc)
"""


def _pytest(tests, src: Path, *extra: str, env: dict | None = None, fresh: bool = False) -> tuple:
    """``(pytest's exit status or None when the process died before pytest returned, the process's exit status,
    the output's lines)`` of ``tests`` against the copy at ``src``: in a process forked from the server that
    preloaded :data:`PRELOAD` (``tests/prefork.py``), or in a fresh interpreter (``fresh``: Triton's interpreter
    must be on before Triton is imported, and the server imported it)."""
    cmd = [sys.executable, "-c", _PYTEST, str(src), "-q", "-p", "no:cacheprovider", *extra,
           *(str(ROOT / t) for t in tests)]
    res = (subprocess.run if fresh else prefork.run)(cmd, env={**_env(src), **(env or {})}, cwd=CWD,
                                                     capture_output=True, text=True, timeout=1800)
    status = [int(ln[len(_STATUS):]) for ln in res.stdout.splitlines() if ln.startswith(_STATUS)]
    lines = [ln for ln in f"{res.stdout.strip()}\n{res.stderr.strip()}".strip().splitlines()
             if not ln.startswith(_STATUS)]
    return (status[-1] if status else None), res.returncode, lines


def _baseline(chosen, src: Path, jobs: int = 1) -> None:
    """Every guarding test passes on the unmutated copy (else a failure would prove nothing)."""
    tests = sorted({t for m in chosen for t in m.tests})
    plain = [t for t in tests if not t.startswith(INTERPRETED)]
    interpreted = [t for t in tests if t.startswith(INTERPRETED)]
    # the interpreted tests skip themselves unless Triton's interpreter is on: run them with it
    by_test = ("-n", str(jobs), "--dist", "load") if _xdist(jobs) else ()  # one file: spread its tests
    for ids, env, xdist in ((plain, None, _xdist(jobs)), (interpreted, {"TRITON_INTERPRET": "1"}, by_test)):
        if not ids:
            continue
        rc, _, out = _pytest(ids, src, *xdist, env=env, fresh=env is not None)
        summary = next((ln for ln in reversed(out) if " passed" in ln), "")
        if rc != 0 or not summary:
            sys.exit("mutations: the guarding tests fail without any mutation:\n" + "\n".join(out)[-3000:])
        print(f"baseline: {summary}", flush=True)


def _stale(mutations) -> list[str]:
    """The mutations whose text is not in their file exactly once (a refactor moved it): the fix is to point the
    mutation at the code that now does what it guards."""
    out = []
    for m in mutations:
        n = (Path(__file__).resolve().parents[1] / "trt_sora" / m.file).read_text().count(m.old)
        if n != 1:
            out.append(f"STALE    {m.name}: trt_sora/{m.file} holds its text {n} times, not once")
    return out


#: Imported once by the forkserver that every mutation's pytest forks from: third-party modules only (the
#: package under test must be imported fresh, from the mutated copy, in each child).
PRELOAD = (*prefork.PRELOAD, "pytest", "_pytest.python", "xdist")


def _forkserver() -> None:
    """Before the server starts: what it imports, and torch's thread count when it does (as :func:`_env`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prefork.context().set_forkserver_preload(list(PRELOAD))


def run_one(m: Mutation, src: Path) -> Outcome:
    path = src / "trt_sora" / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return Outcome(m, "STALE", 0.0, f"{m.file}: the text to mutate occurs {text.count(m.old)} times, not once")
    path.write_text(text.replace(m.old, m.new))
    t0 = time.perf_counter()
    try:
        interpreted = all(t.startswith(INTERPRETED) for t in m.tests)
        rc, died, out = _pytest(m.tests, src, "-x", env={"TRITON_INTERPRET": "1"} if interpreted else None,
                                fresh=interpreted)
        if rc is None and interpreted and died < 0:  # a kernel's bad access killed the interpreter: the file's
            rc, out = 1, [f"the interpreted tests' process died of signal {-died} (the runner test fails)"]
        elif rc is None:
            rc = f"none (the process died: {died})"
    finally:
        path.write_text(text)
    dt = time.perf_counter() - t0
    last = (out or [""])[-1]
    if rc == 1:
        return Outcome(m, "caught", dt, last)
    if rc == 0:
        return Outcome(m, "SURVIVED", dt, last)
    return Outcome(m, "ERROR", dt, f"pytest exit {rc}: {' / '.join(out[-3:])[-300:]}")


def _table(outcomes: list[Outcome]) -> str:
    rows = ["| mutation | guards | tests run | caught | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        tests = ", ".join(t.split("::")[-1] if "::" in t else t for t in o.mutation.tests)
        rows.append(f"| {o.mutation.name} | {o.mutation.guards} | {tests} | {o.verdict} | {o.seconds:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", action="store_true", help="only the mutations whose tests need no run folder")
    p.add_argument("--only", action="append", default=[], help="run this mutation (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="mutations run at once, each in its own package copy (default: the CPU count)")
    args = p.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        p.error(f"unknown mutation {unknown[0]!r}; --list shows them")
    chosen = [m for m in MUTATIONS if (not args.only or m.name in args.only) and (m.fast or not args.fast)]
    if args.list:
        for m in chosen:
            print(f"{m.name:26s} {'fast' if m.fast else 'slow'}  {m.guards}")
        return 0
    stale = _stale(MUTATIONS)  # every mutation, the slow ones too: a text that moved guards nothing
    if stale:
        print("\n".join(stale))
        return 1
    jobs = max(1, min(args.jobs, len(chosen)))
    with tempfile.TemporaryDirectory(prefix="trt_sora_mutations_") as tmp:
        copies = queue.SimpleQueue()  # one package copy per job: a job mutates only its own
        for i in range(jobs):
            src = _copy_package(Path(tmp) / f"job{i}")
            _check_import_path(src)
            copies.put(src)
        _forkserver()
        _baseline(chosen, src, jobs)

        def run(m: Mutation) -> Outcome:
            src = copies.get()
            try:
                o = run_one(m, src)
            finally:
                copies.put(src)
            print(f"{o.verdict:8s} {m.name} ({o.seconds:.0f} s) {o.detail}", flush=True)
            return o

        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(run, chosen))  # the table in the list's order
    print()
    print(_table(outcomes))
    bad = [o for o in outcomes if o.verdict != "caught"]
    print(f"\n{len(outcomes) - len(bad)} of {len(outcomes)} mutations caught" +
          (f"; not caught: {', '.join(o.mutation.name for o in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
