#!/usr/bin/env bash
# One device call on the lent H200: install the carried wheels, then run the named parts, each
# under its own time limit, logs and JSON under $OUT (what comes back). Parts run in the order given;
# a failed part does not stop the next one.
#
#   bash benchmarks/h200.sh tests attention quality m13 m14 ...
#
# Parts: tests (pytest -m gpu), e2e (seconds per clip stage by stage, Wan 14B 480p x 81: benchmarks/e2e_bench.py),
# tail (issue 30: the clip's tail alone, Wan 2.1's VAE at its real size on a 480p x 81 latent: serial decode + MP4
# vs the runtime's streamed groups, cudnn.benchmark, x264 presets; benchmarks/tail_bench.py, needs the
# imageio-ffmpeg wheel in .whl), e2eclip (two whole 50-step 14B clips of ours measured end to end, the cached one first with the schedule check
# accepted on wan-shapes at 50 steps - plan global, damped, 59% of branch calls saved (session 18) - or E2ECLIP_SCHEDULE; the JSON after each clip), ws (the warp-specialized Gluon attention kernel vs the Triton one: bits, speed;
# WS_CONFIGS picks its configs; WS_VARIANTS=name=path,... other builds of the Gluon module), wsn (the Triton attention
# kernel's 256-key tiles vs its default 128: benchmarks/attention_tiles.py), gemm (block GEMMs,
# exact vs fast FP8 accumulation), attention (kernel vs
# cuDNN/flash), cudnn_attn (issue 32: our 8-bit Triton kernel vs cuDNN's FP8 SDPA alone, 1 x 40 x 32,760 x 128;
# needs the nvidia-cudnn-frontend wheel in .whl; cudnn_tests: its GPU tests), m14cudnn (the 14B 480p call with cuDNN's FP8 SDPA as the
# attention kernel beside the Triton one, eager with the profiler split and graphed), attn_model (the attention kernel inside a 14B call vs alone, with clocks and power; attn_model_cute: the CuTe
# kernel's, the DSL as for cute), quality (wan-shapes clips),
# levers (issue 13: FP8/INT8 quantization levers on 17 wan-shapes clips at 20 steps, vs fp32; needs
# build/lev/prompts.safetensors + prompts.text.safetensors from `python benchmarks/quality_levers.py --encode
# --out build/lev/prompts.safetensors` on CPU, carried),
# check (trt-sora check --backend torch-fp8 on the wan-shapes run folder; the held-out prompts' embeddings from
# `python benchmarks/fp8_quality.py --encode` (CPU), carried: the GPU box has no text encoder),
# serve (after check: the serve GPU test, then serve_bench with and without dynamic batching on torch-fp8;
# needs the serve extra's wheels: fastapi, uvicorn, prometheus-client, imageio-ffmpeg),
# m13 / m14 (one transformer call, 480p x 81, batch 1: eager, compile, the torch-fp8 ladder),
# calib13 / calib14 (calibration observer overhead; CALIB_VARIANTS picks calib13's observer paths),
# famcheck (issue 32: `trt-sora check --backend torch-fp8 --device cuda` on each family's tiny run folder,
# build/fam/<model>/rtx4090-fp8 from `trt-sora engine --recipe rtx4090-fp8 --model M --out build/fam --stages
# export,calibrate,quantize` on the CPU, carried; FAMCHECK_MODELS picks them; reports under $OUT/famcheck/),
# fa4 (issue 32: flash-attn-4's CuTe DSL forward as a peer, SM 9.0 BF16, beside our 8-bit kernel and cuDNN: its
# wheels installed with `pip install --target /tmp/fa4site --python-version 3.12 --platform manylinux_2_28_x86_64
# --only-binary=:all:` on the CPU (flash-attn-4, nvidia-cutlass-dsl and its libs-base/-core/-cu13, cuda-bindings,
# cuda-pathfinder, apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels, einops), `tar -c fa4site | xz -9e`, split
# in 37 MB pieces (`split -b 37000000`) over build/cute/a, build/cute/b, carried one folder per chained call: ignored build outputs stay
# on a warm machine between calls, and the 64 MiB carry holds the tracked tree too),
# cute (issue 32: our CuTe DSL 8-bit attention kernel vs the Triton one: agreement on six shapes, speed at 32,760
# tokens, benchmarks/cute_attention.py; the DSL from the fa4 part's carried pieces; CUTE_VARIANTS picks schedules;
# CUTE_TRACE=overlap_lazy,...: those first, traced: the cycles of each key tile's phases),
# m14cute (the 14B 480p call with torch_fp8.attention_kernel int8-cute beside the Triton kernel: eager with the
# profiler split, and graphed; the DSL as for cute; M14CUTE_SCHEDULE, e.g. overlap=0,lookahead=1: the kernel's
# schedule; KERNEL_SETTINGS: a JSON of the Triton kernels' launch settings, e.g. the epi part's output, its best
# ones; M14CUTE_RUNGS: other rungs, e.g. ..._graph_cute,..._graph_cute_prev (benchmarks/_prev_triton_ops.py's
# Triton kernels); needs diffusers' wheel), cute_tests (the CuTe kernel's GPU tests, the DSL on the path; pytest from the
# WHL carry: build/pyt holds pytest, pluggy, iniconfig and diffusers, 6.5 MB beside the DSL's 40 MB piece),
# epi (the memory-bound kernels of the 14B call at its size: residual_norm_quant and the fused-QKV epilogue by
# warps, gelu_quant, each kernel's time and its outputs vs the shipped setting's;
# benchmarks/_prev_triton_ops.py beside it: that commit's kernels too; benchmarks/epilogue_bench.py),
# hist (one batch's |x| histogram several ways; HIST_ARGS=--only-cuda: the torch path and the NVRTC kernel),
# m14b2 (14B batch 2), m14_720 (14B 720p batch 1), m14sparse (issue 32: the 14B 720p call, the full torch-fp8 rung
# dense and with block-sparse attention per window of SPARSE_WINDOWS (4-2-2,2-2-2), iters 5, one eager call), m14x (14B 480p batch 2, 720p batch 1 and 2: eager vs full torch-fp8,
# one model build, no profiler; the JSON keeps what finished), prof14 (profiler of the 14B fp8 call),
# peer (issue 17: wan-shapes calibrated here, then NVIDIA ModelOpt's FP8 recipe vs ours on 16 held-out
# prompts at 20 steps; needs build/wan_shapes_peer_prompts.safetensors from
# `python benchmarks/peer_modelopt.py embed --model wan-shapes --num 16 --out ...` and ModelOpt's wheels in .whl).
# Step caching (issue 30; EMB: build/wan_shapes_peer_prompts.safetensors from `python benchmarks/peer_modelopt.py
# embed --model wan-shapes --num 16 --out build/wan_shapes_peer_prompts.safetensors` on CPU, carried):
# ccalib (a run folder $CCW/run from $RUN/export, or exported here when $RUN has none, calibrated here at CC_STEPS
# (50) and quantized), cache50 / cache20 (benchmarks/caching_bench.py: wan-shapes fp32, 16 held-out captions at 50 / 20
# steps, a grid of extrapolate settings vs the uncached clips; the step statistics of ccalib's calibration at
# CC_STEPS, else calibrated in the part; CACHE50_GRID / CACHE20_GRID), checkcache (after ccalib: the best setting of
# $OUT/cache$CC_STEPS.json that passed into the recipe, then trt-sora check --backend torch-fp8 with caching), gen
# (after checkcache: trt-sora generate on that run folder with the checked setting, per-stage seconds), cserve
# (after checkcache: benchmarks/serve_bench.py serving that run folder with $EMB's captions at CC_STEPS, batched and
# unbatched, CSERVE_REQUESTS (16) requests by 4 clients: clips/s, p50/p95, the caching served; needs the serve
# extra's wheels: fastapi, uvicorn, prometheus-client).
# damp50 (benchmarks/caching_orders.py: wan-shapes fp32, 16 held-out captions at 50 steps, cross-fitted halves: the
# errors of the line, the parabola and the damped line (fixed and calibrated alpha), then the global plan's 56 / 58 /
# 60% schedules sampled with the calibrated alpha and with the line vs the uncached clips; DAMP_ARGS: more arguments,
# the last wins).
# CACHE_METHOD (extrapolate, magcache; +cfg: CFG-branch reuse on top, the grids CACHE50_CFG_GRID / CACHE20_CFG_GRID
# of threshold:max_skips:warmup:cfg_reuse:cfg_order) picks the method of cacheN, ccalib and checkcache.
# CACHE_PLAN (runs; global: caching.plan global, the threshold is the clip's error budget, the grids
# CACHE50_GLOBAL_GRID / CACHE20_GLOBAL_GRID) picks the plan of cacheN and checkcache.
#   bash benchmarks/h200.sh ccalib cache50 checkcache gen cserve cache20
#   CACHE_METHOD=extrapolate+cfg bash benchmarks/h200.sh ccalib cache50 checkcache gen cserve cache20
#   CACHE_PLAN=global bash benchmarks/h200.sh ccalib cache50 checkcache gen
# CC_CURVE: checkcache's curve instead of this call's cacheN (e.g. a committed one; $CCW/run calibrated before,
# on the CPU too, and carried):
#   CCW=build/cc CC_CURVE=benchmarks/results/h100_caching_wan-shapes_50steps_global_damped_wide_2026-12-06.json \
#     CACHE_PLAN=global CACHE_DAMPING=0.5 bash benchmarks/h200.sh checkcache gen cserve
# CACHE_DAMPING (1: the line; e.g. 0.5) sets caching.damping of cacheN's rows and checkcache's recipe:
#   CACHE_PLAN=global CACHE_DAMPING=0.5 CACHE50_GLOBAL_GRID=0.8:3:10,0.9:3:10,1.1:3:10 bash benchmarks/h200.sh ccalib cache50 checkcache
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# CUTE=1: the CuTe DSL (build/cute/*'s pieces, unpacked once into /tmp/fa4site) on every part's path, for
# runs of torch_fp8.attention_kernel int8-cute: e.g. CUTE=1 E2ECLIP_ARGS="--attention-kernel int8-cute"
# WHL: the carried wheels' folders, space-separated (default .whl; e.g. build/pyt, pytest alone, beside the DSL's
# 40 MB piece; or "build/psrv_a build/psrv_b", wheels carried over two calls to stay under the carry limit)
WHL=${WHL:-.whl}
WHEELS=$(for w in $WHL; do [ -d "$w" ] && ls "$w"/*.whl; done)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
fi
# the DSL's site (flash-attn-4 and its CuTe DSL wheels), unpacked once from the carried pieces, and its path
DSL_UNPACK="[ -d /tmp/fa4site/nvidia_cutlass_dsl ] || cat build/cute/*/fa4site.part-* | xz -d | tar -xf - -C /tmp"
DSL_PATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
if [ -n "${CUTE:-}" ]; then
  eval "$DSL_UNPACK" || { echo "the CuTe DSL pieces are missing: carry build/cute/a, then build/cute/b"; exit 1; }
  export PYTHONPATH=${PYTHONPATH:-$PWD}:$DSL_PATH
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
RUN=${RUN:-build/wan-shapes/rtx4090-fp8}
EMB=${EMB:-build/wan_shapes_peer_prompts.safetensors}
CCW=${CCW:-/tmp/cc}  # not CC: that names the C compiler (Triton reads it)
CC_STEPS=${CC_STEPS:-50}
CC_DEVICE=${CC_DEVICE:-cuda}  # cpu (with CC_BACKEND=ort, CC_STEPS=2, part cache2): a dry run of the parts
CC_BACKEND=${CC_BACKEND:-torch-fp8}
CC_LIMIT=${CC_LIMIT:-300}  # seconds of each of ccalib, cacheN, checkcache
GEN_OUT=${GEN_OUT:-clip.mp4}  # clip.gif without the imageio-ffmpeg wheel
CAPTION=${CAPTION:-a green triangle slides left over a striped black background}
CACHE50_GRID=${CACHE50_GRID:-0.02:1:2,0.05:1:2,0.1:1:2,0.3:1:2,0.05:2:2,0.1:2:2,0.2:2:2,0.5:2:2,0.1:3:2,0.3:3:2,1:3:2,0.2:4:2,0.5:4:2,2:4:2,10:4:2}
CACHE20_GRID=${CACHE20_GRID:-0.05:1:2,0.1:1:2,0.1:2:2,0.2:2:2,0.5:2:2,0.3:3:2,1:3:2,10:2:2,10:4:2}
CACHE_METHOD=${CACHE_METHOD:-extrapolate}
CACHE50_CFG_GRID=${CACHE50_CFG_GRID:-0.05:1:2:0.02:0,0.05:1:2:0.05:0,0.1:1:2:0.05:0,0.1:1:2:0.1:0,0.2:2:2:0.05:0,0.2:2:2:0.1:0,0.5:2:2:0.1:0,0.1:1:8:0.1:0,0.3:3:2:0.1:0,0.1:1:2:0.05:1}
CACHE20_CFG_GRID=${CACHE20_CFG_GRID:-0.05:1:2:0.032:0,0.05:1:2:0.046:1,0.05:1:2:0.038:0,0.05:1:2:0.04:0,0.05:1:2:0.054:1,0.1:1:8:0.03:0,0.1:1:8:0.045:0}
if [ "${CACHE_METHOD%+cfg}" != "$CACHE_METHOD" ]; then CACHE50_GRID=$CACHE50_CFG_GRID; CACHE20_GRID=$CACHE20_CFG_GRID; fi
CACHE_METHOD=${CACHE_METHOD%+cfg}
CACHE_PLAN=${CACHE_PLAN:-runs}
CACHE_DAMPING=${CACHE_DAMPING:-1}  # caching.damping of cacheN and checkcache (extrapolate: 1 is the line)
# budgets of plan global, from the 50-step errors of h100_caching_wan-shapes_50steps_grid2: 0.5:2:2 reuses 24
# of 50 steps (the runs plan's passing 48%), 0.8-0.97 29 (58%), 1:3:2 32 (64%); warm-ups 10-14 keep steps
# 2-8 computing (the 50-step rows that reused 4-8 without 2 lost one caption)
CACHE50_GLOBAL_GRID=${CACHE50_GLOBAL_GRID:-0.5:2:2,0.6:2:2,0.8:3:2,1:3:2,0.63:3:10,0.8:3:10,0.9:3:10,1:4:10,1.2:4:10,0.97:4:12,0.85:4:14,0.8:3:10:0.05:0,0.9:3:10:0.05:0,0.9:3:10:0.07:1}
CACHE20_GLOBAL_GRID=${CACHE20_GLOBAL_GRID:-0.21:2:2,0.26:2:2,0.26:2:2:0.038:0,0.26:2:2:0.03:0,0.26:2:2:0.07:1,0.35:3:7,0.5:3:7}
if [ "$CACHE_PLAN" = global ]; then CACHE50_GRID=$CACHE50_GLOBAL_GRID; CACHE20_GRID=$CACHE20_GLOBAL_GRID; fi
# issue 13's lever table (benchmarks/quality_levers.py; ModelOpt's last: it needs nvidia-modelopt)
LEVERS=${LEVERS:-bf16,fp8_mse_wch,fp8_minmax_wch,fp8_mse_wtensor,fp8_minmax_wtensor,fp8_mse_wch_gptq,fp8_minmax_wch_gptq,fp8_mse_wch_gptq_last2,fp8_mse_wch_last4,fp8_mse_wch_first4,fp8_mse_wch_excl=ffn.down,int8_minmax_wch,int8_mse_wch,int8_percentile_wch,int8_mse_wch_gptq,int8_minmax_wch_gptq,int8_minmax_wch_sq0.5,int8_mse_wch_gptq_last2,modelopt,modelopt_wch}
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'

part() {  # name, limit_s, command...
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (limit ${lim}s)"
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}

for p in "$@"; do
  case $p in
    e2e) part e2e ${E2E_LIMIT:-540} python3 benchmarks/e2e_bench.py ${E2E_ARGS:-} --out "$OUT/e2e.json" ;;
    tail) part tail ${TAILB_LIMIT:-240} python3 benchmarks/tail_bench.py ${TAILB_ARGS:-} --out "$OUT/tail.json" ;;
    e2eclip) part e2eclip ${E2ECLIP_LIMIT:-560} python3 benchmarks/e2e_bench.py --measure clips ${E2ECLIP_ARGS:-} \
              --cache-schedule "${E2ECLIP_SCHEDULE:-benchmarks/results/h100_check_generate_caching_cfg_damped_wan-shapes_2026-12-06.json}" \
              --out "$OUT/e2eclip.json" ;;
    tests) part tests ${TESTS_LIMIT:-360} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests} ;;
    calib13) part calib13 300 bash -c "python3 benchmarks/calib_overhead.py --model wan2.1-t2v-1.3b --cfg split --variants ${CALIB_VARIANTS:-r2,shipped} --out $OUT/calib13_split.json && python3 benchmarks/calib_overhead.py --model wan2.1-t2v-1.3b --cfg batched --variants ${CALIB_VARIANTS:-r2,shipped} --out $OUT/calib13_batched.json" ;;
    calib14) part calib14 360 python3 benchmarks/calib_overhead.py --model wan2.1-t2v-14b --cfg batched --reps 3 --variants ${CALIB14_VARIANTS:-shipped} --out "$OUT/calib14_batched.json" ;;
    attn_model) part attn_model 400 python3 benchmarks/fp8_bench.py --parts attention_in_model \
                  --out "$OUT/attn_model.json" ;;
    attn_model_cute) part attn_model_cute ${ATTN_MODEL_LIMIT:-420} bash -c "set -e; $DSL_UNPACK
               PYTHONPATH=\$PYTHONPATH:$DSL_PATH python3 benchmarks/fp8_bench.py --parts attention_in_model \
                 --attention-kernel int8-cute --out $OUT/attn_model_cute.json" ;;
    wsn) part wsn 240 python3 benchmarks/attention_tiles.py --out "$OUT/wsn.json" ;;
    ws) part ws 300 python3 benchmarks/gluon_attention.py ${WS_CONFIGS:+--configs "$WS_CONFIGS"} \
          ${WS_VARIANTS:+--variants "$WS_VARIANTS"} --out "$OUT/ws.json" ;;
    cudnn_tests) part cudnn_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_cudnn_attention.py \
                   tests/runtime/test_torch_fp8.py -k cudnn ;;
    cudnn_attn) part cudnn_attn 300 python3 benchmarks/fp8_bench.py --parts cudnn_attention --out "$OUT/cudnn_attn.json" ;;
    m14cudnn) part m14cudnn 300 python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --batches 1 \
                --iters 5 --rungs fp8_fused_attn8_graph,fp8_fused_attn8_cudnn,fp8_fused_attn8_graph_cudnn \
                --out "$OUT/m14cudnn.json" ;;
    cute_tests) part cute_tests ${CUTE_TESTS_LIMIT:-240} bash -c "set -e; $DSL_UNPACK
               PYTHONPATH=\$PYTHONPATH:$DSL_PATH python3 -m pytest -q -m gpu \
                 -p no:cacheprovider tests/kernels/test_cute_attention.py tests/runtime/test_torch_fp8.py -k cute" ;;
    m14cute) part m14cute ${M14CUTE_LIMIT:-360} bash -c "set -e; $DSL_UNPACK
               PYTHONPATH=\$PYTHONPATH:$DSL_PATH python3 benchmarks/fp8_bench.py --parts models \
                 --models wan2.1-t2v-14b --batches 1 --iters 5 \
                 --rungs ${M14CUTE_RUNGS:-fp8_fused_attn8_graph,fp8_fused_attn8_cute,fp8_fused_attn8_graph_cute} \
                 ${M14CUTE_SCHEDULE:+--cute-schedule $M14CUTE_SCHEDULE} \
                 ${KERNEL_SETTINGS:+--kernel-settings $KERNEL_SETTINGS} --out $OUT/m14cute.json" ;;
    gemm) part gemm 120 python3 benchmarks/fp8_bench.py --parts gemm --out "$OUT/gemm.json" ;;
    epi) part epi ${EPI_LIMIT:-300} python3 benchmarks/epilogue_bench.py ${EPI_ARGS:-} --out "$OUT/epi.json" ;;
    attention) part attention 240 python3 benchmarks/fp8_bench.py --parts attention --out "$OUT/attention.json" ;;
    quality) part quality 240 python3 benchmarks/fp8_quality.py --run "$RUN" \
               --prompts build/wan_shapes_heldout.safetensors --num 16 --out "$OUT/quality.json" ;;
    peer) part peer 540 bash -c "rm -rf /tmp/peer_calib && python3 -m trt_sora calibrate --model wan-shapes \
            --recipe rtx4090-fp8 --device cuda --no-report --text-embeddings build/wan_shapes_peer_prompts.safetensors \
            --out /tmp/peer_calib && python3 benchmarks/peer_modelopt.py table --calib /tmp/peer_calib --num 16 \
            --prompts build/wan_shapes_peer_prompts.safetensors --device cuda --out $OUT/peer.json" ;;
    levers) part levers 540 bash -c "python3 benchmarks/quality_levers.py --calibrate build/lev --device cuda \
              --prompts build/lev/prompts.safetensors && \
              python3 benchmarks/quality_levers.py --calib fp8_e4m3=build/lev/calib_fp8_e4m3 \
              --calib int8=build/lev/calib_int8 --prompts build/lev/prompts.safetensors --device cuda \
              --variants \"$LEVERS\" --out $OUT/levers.json" ;;
    hist) part hist 120 python3 benchmarks/hist_bench.py ${HIST_ARGS:-} --out "$OUT/hist.json" ;;
    ktests) part ktests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/calibrate/test_histogram.py ;;
    check) part check 200 python3 -m trt_sora check --run "$RUN" --recipe rtx4090-fp8 --backend torch-fp8 --device cuda \
             --text-embeddings build/wan_shapes_heldout.safetensors ;;
    serve) part serve 540 bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider tests/serve; \
             python3 benchmarks/serve_bench.py --run $RUN --backend torch-fp8 --requests 32 --concurrency 8 \
             --out $OUT/serve.json" ;;
    m13) part m13 300 python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-1.3b --batches 1 \
           --out "$OUT/m13.json" ;;
    m14) part m14 ${M14_LIMIT:-540} python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --batches 1 \
           --rungs "${M14_RUNGS:-compile_bf16,fp8_gemm,fp8_fused,fp8_fused_attn8,fp8_fused_attn8_graph}" ${M14_ARGS:-} \
           ${KERNEL_SETTINGS:+--kernel-settings $KERNEL_SETTINGS} --out "$OUT/m14.json" ;;
    m14x) part m14x 560 python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --points 480p:2,720p:1,720p:2 \
            --iters 10 --no-profile --rungs fp8_fused_attn8_graph --out "$OUT/m14x.json" ;;
    m14b2) part m14b2 540 python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --batches 2 \
             --iters 10 --rungs fp8_fused_attn8_graph --out "$OUT/m14b2.json" ;;
    m14_720) part m14_720 540 python3 benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --sizes 720p \
               --batches 1 --iters 10 --rungs fp8_fused_attn8_graph --out "$OUT/m14_720.json" ;;
    m14sparse) part m14sparse ${M14SPARSE_LIMIT:-300} python3 benchmarks/fp8_bench.py --parts models \
                 --models wan2.1-t2v-14b --points 720p:1 --iters 5 --eager-iters 1 --no-profile \
                 --rungs fp8_fused_attn8_graph,fp8_fused_attn8_graph_sparse --sparse-windows "${SPARSE_WINDOWS:-4-2-2,2-2-2}" \
                 --out "$OUT/m14sparse.json" ;;
    e2e720) part e2e720 ${E2E720_LIMIT:-300} python3 benchmarks/e2e_bench.py --size 720p --paths eager,ours --steps 2 \
              --out "$OUT/e2e720.json" ;;
    fam) part fam ${FAM_LIMIT:-300} python3 benchmarks/fp8_bench.py --parts models \
           --models "${FAM_MODELS:-hunyuanvideo-1.5-480p-t2v,wan2.2-ti2v-5b}" --points 480p:1 --iters 5 --no-profile \
           --rungs "${FAM_RUNGS:-compile_bf16,fp8_fused_attn8_graph}" --out "$OUT/fam.json" ;;
    famcheck) part famcheck ${FAMCHECK_LIMIT:-300} bash -c "for m in ${FAMCHECK_MODELS:-wan-tiny wan-i2v-tiny wan-ti2v-tiny wan-a14b-tiny hunyuan-tiny}; do \
                r=build/fam/\$m/rtx4090-fp8; python3 -m trt_sora check --run \$r --backend torch-fp8 --device cuda \
                > $OUT/famcheck_\$m.log 2>&1; echo \"\$m check rc=\$?\"; mkdir -p $OUT/famcheck/\$m; \
                cp \$r/parity/report.json \$r/parity/report.md $OUT/famcheck/\$m/ 2>/dev/null; done" ;;
    fa4) part fa4 ${FA4_LIMIT:-420} bash -c "set -e; $DSL_UNPACK
           python3 benchmarks/fp8_bench.py --parts fa4_attention --fa4-site /tmp/fa4site --fa4-tokens ${FA4_TOKENS:-32760} --out $OUT/fa4.json" ;;
    cute) part cute ${CUTE_LIMIT:-400} bash -c "set -e; $DSL_UNPACK
           python3 benchmarks/cute_attention.py --site /tmp/fa4site ${CUTE_VARIANTS:+--variants $CUTE_VARIANTS} ${CUTE_TRACE:+--trace $CUTE_TRACE} --watchdog $(( ${CUTE_LIMIT:-400} - 45 )) --out $OUT/cute.json" ;;
    sparse) part sparse ${SPARSE_LIMIT:-150} python3 benchmarks/sparse_attention.py --out "$OUT/sparse.json" ;;
    onnxrepro) part onnxrepro 240 bash -c "set -e; X=/tmp/onnxrepro; rm -rf \$X; \
                 python3 -m trt_sora export --model wan-tiny --recipe rtx4090-fp8 --out \$X/export; \
                 python3 -m trt_sora calibrate --model wan-tiny --recipe rtx4090-fp8 --no-report --out \$X/calib; \
                 python3 -m trt_sora quantize --onnx \$X/export/model.onnx --stats \$X/calib/stats.safetensors \
                   --recipe rtx4090-fp8 --out \$X/quant; mkdir -p $OUT/onnxrepro; cp -r \$X/export \$X/quant $OUT/onnxrepro/; \
                 python3 -c 'import onnxruntime as ort, sys
for lvl in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    o = ort.SessionOptions(); o.graph_optimization_level = lvl
    try:
        ort.InferenceSession(sys.argv[1], o, providers=[\"CPUExecutionProvider\"]); print(lvl, \"loads\")
    except Exception as e:
        print(lvl, \"FAILS\", str(e)[:300])
print(ort.__version__)' \$X/quant/model.qdq.onnx" ;;
    ccalib) part ccalib $CC_LIMIT bash -c "set -e; python3 benchmarks/cache_check.py prepare --run '$RUN' --work $CCW \
              --steps $CC_STEPS --method $CACHE_METHOD --fresh
            [ -d $CCW/run/export ] || python3 -m trt_sora export --model wan-shapes --recipe $CCW/recipe.yaml \
              --out $CCW/run/export
            python3 -m trt_sora calibrate --model wan-shapes --recipe $CCW/recipe.yaml --device $CC_DEVICE --no-report \
              --text-embeddings '$EMB' --out $CCW/run/calib
            W=$CCW/run/calib/weights.safetensors; python3 -m trt_sora quantize --onnx $CCW/run/export/model.onnx \
              --stats $CCW/run/calib/stats.safetensors \$([ -f \$W ] && echo --weights \$W) --recipe $CCW/recipe.yaml \
              --out $CCW/run/quant" ;;
    cache[0-9]*) R=$CCW/run/calib/step_ratios.safetensors; [ "${p#cache}" = "$CC_STEPS" ] && [ -f $R ] || R=
                     part $p $CC_LIMIT python3 benchmarks/caching_bench.py --device $CC_DEVICE --steps ${p#cache} --method $CACHE_METHOD \
                       --plan $CACHE_PLAN --damping $CACHE_DAMPING \
                       --captions 16 --threads 8 --text-embeddings "$EMB" ${R:+--ratios $R} --configs "$([ $p = cache20 ] \
                       && echo "$CACHE20_GRID" || echo "$CACHE50_GRID")" --out "$OUT/$p.json" ;;
    damp50) TAIL=20 part damp50 ${DAMP_LIMIT:-300} python3 benchmarks/caching_orders.py --device $CC_DEVICE --steps 50 \
              --captions 16 --cross-fit --alphas 0.5,0.7,0.85 --threads 8 --text-embeddings "$EMB" \
              --curve benchmarks/results/h100_caching_wan-shapes_50steps_global_2026-12-06.json \
              --settings 0.8:3:10,0.9:3:10,1.1:3:10 --sample calibrated,order1 --trajectories /tmp/damp50.pt \
              ${DAMP_ARGS:-} --out "$OUT/damp50.json" ;;
    checkcache) TAIL=40 part checkcache $CC_LIMIT bash -c "set -e; python3 benchmarks/cache_check.py prepare --run '$RUN' \
                  --work $CCW --steps $CC_STEPS --method $CACHE_METHOD --plan $CACHE_PLAN --damping $CACHE_DAMPING --curve ${CC_CURVE:-$OUT/cache$CC_STEPS.json}
                trap 'cp $CCW/recipe.yaml $CCW/run/parity/report.json $CCW/run/parity/report.md $OUT/ 2>/dev/null' EXIT
                python3 -m trt_sora check --run $CCW/run --recipe $CCW/recipe.yaml --backend $CC_BACKEND --device $CC_DEVICE \
                  --text-embeddings '$EMB'" ;;
    gen) TAIL=12 part gen 200 bash -c "set -e; python3 -m trt_sora generate --run $CCW/run --backend $CC_BACKEND --device $CC_DEVICE \
           --text-encoder '$EMB' --steps $CC_STEPS '$CAPTION' -o $OUT/$GEN_OUT
         python3 benchmarks/cache_check.py show $OUT/$GEN_OUT.json" ;;
    cserve) TAIL=4 part cserve ${CSERVE_LIMIT:-240} python3 benchmarks/serve_bench.py --run $CCW/run \
              --backend $CC_BACKEND --device $CC_DEVICE --steps $CC_STEPS --text-encoder "$EMB" --prompts-from "$EMB" \
              --requests ${CSERVE_REQUESTS:-16} --concurrency 4 --out "$OUT/cserve.json" ;;
    *) echo "unknown part $p" ;;
  esac
done
