#!/usr/bin/env bash
# Every GPU check and figure of the project in one call of the device machine:
#   the checkpoint parity matrix through pd generate --device cuda, kernels vs their torch
#   twins, MTP engine parity, the same tokens under MPS at shares of the multiprocessors, GPU
#   tests (graphs, fused kernels, KV fast path, P+D on CUDA), KV transfer (the ring by hand,
#   then each tier through the transport's API), decode attention, the skinny product vs cuBLAS,
#   decode/prefill vs floors and HF (and without the skinny kernel, and with SiLU as its own
#   kernel), where a prefill's time goes, CUDA graphs vs eager, the decode step's kernels and
#   host time (profiler), overlap on/off (parity of 64 requests, sync check, throughput and
#   step gap), MTP on/off (graphed, overlap on/off, logprobs; the norms apart from the
#   products: PD_PROLOGUE=0, and the fused products timed alone) and the MTP machinery on the
#   1B shape, the token-logprob kernels,
#   structured output's cost and where a JSON step's time goes (host and device on one clock;
#   grammars on the GPU: the same tokens as transformers' masked logits). Logs go to $OUT (or
#   ./out) and one table each to stdout.
#     bash benchmarks/gpu/run_all.sh [1|2|3|4|5|6]  (1: checks, KV, attention, decode; 2: graphs,
#                                                 profile, overlap, MTP; 3: two GPUs: KV between
#                                                 them, the mixed load over each tier;
#                                                 4: the decode node's host work per request
#                                                 and per call inside the loop,
#                                                 prefix caching and serving against the
#                                                 engine through pd launch; 5: two GPUs:
#                                                 tensor parallelism's PD test, parity and step;
#                                                 6: the skinny product on 8B layers, whole
#                                                 and as one of two ranks holds them)
#     ONLY=name,name bash benchmarks/gpu/run_all.sh [part]   runs only the steps so named
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
step() {  # step NAME CMD...: run one part, keep its log, remember a failure
    local name=$1; shift
    if [[ -n ${ONLY:-} && " ${ONLY//,/ } " != *" $name "* ]]; then return; fi
    echo "=== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1 || { echo "FAILED ($?): $name"; status=1; }
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
PART=${1:-all}
if [[ $PART == all || $PART == 1 ]]; then
TAIL=14 step checkpoints python3 benchmarks/gpu/check_checkpoints.py
TAIL=8 step kernels python3 benchmarks/gpu/check_kernels.py
TAIL=12 step mtp_engine python3 benchmarks/gpu/check_mtp_engine.py
# the same tokens with the GPU shared under MPS at 90 / 75 / 50 / 25% of its multiprocessors
# (or the engine's refusal to start where its 16-bit products come out wrong)
TAIL=30 step sm_share timeout 900 python3 benchmarks/gpu/check_sm_share.py --switches
TAIL=8 step mtp_engine_torch_attention env PD_ATTENTION=torch python3 benchmarks/gpu/check_mtp_engine.py
TAIL=4 step pytest python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py tests/kernels \
    tests/shm_ipc/test_kv.py tests/engine/test_device_check.py
TAIL=4 step pd_path env PD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_pd_path.py -k equals_single_process
TAIL=4 step grammar_logprobs env PD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_grammar.py tests/engine/test_logprobs.py
TAIL=15 step kv timeout 300 python3 benchmarks/gpu/bench_kv.py --record-mib 16 64 --profile \
    --trace-dir "$OUT"
TAIL=6 step kv_tiers timeout 300 python3 benchmarks/bench_kv_tiers.py --device cuda
TAIL=8 step attention python3 benchmarks/gpu/bench_attention.py
TAIL=12 step skinny python3 benchmarks/gpu/bench_skinny.py --quick --rows 1 64
TAIL=14 step decode python3 benchmarks/gpu/bench_decode.py
TAIL=6 step decode_no_skinny env PD_SKINNY=0 python3 benchmarks/gpu/bench_decode.py --no-hf --prefill
TAIL=6 step decode_no_silu_epilogue env PD_SILU_EPILOGUE=0 python3 benchmarks/gpu/bench_decode.py \
    --no-hf --prefill
TAIL=22 step profile_prefill python3 benchmarks/gpu/profile_prefill.py --top 8
fi
if [[ $PART == all || $PART == 2 ]]; then
TAIL=8 step graphs python3 benchmarks/gpu/check_graphs.py
TAIL=60 step profile env PD_PDL=0 python3 benchmarks/gpu/profile_decode.py --batch 1 64 --host 64
TAIL=9 step overlap_tiny python3 benchmarks/bench_overlap.py --device cuda --parity 64 --check-sync
TAIL=6 step overlap_small python3 benchmarks/bench_overlap.py --device cuda --synthetic small
TAIL=6 step overlap_small_eager python3 benchmarks/bench_overlap.py --device cuda --synthetic small --enforce-eager
TAIL=64 step mtp python3 benchmarks/bench_mtp.py --device cuda --ks 0,1,3 --max-tokens 256 --repeats 3
TAIL=24 step mtp_eager python3 benchmarks/bench_mtp.py --device cuda --enforce-eager --ks 0,3 --overlap on
TAIL=36 step mtp_mechanism python3 benchmarks/gpu/bench_mtp_mechanism.py
TAIL=11 step token_logprob python3 benchmarks/gpu/bench_token_logprob.py
TAIL=14 step profile_mtp python3 benchmarks/gpu/profile_mtp.py --k 3 --batch 16 --top 8
TAIL=44 step mtp_kernels python3 benchmarks/gpu/profile_mtp.py --k 3 --batch 1 --kernels --top 10 \
    --max-tokens 64
TAIL=8 step mtp_device_time python3 benchmarks/gpu/profile_mtp.py --k 3 --batch 1 --device-time --top 6
TAIL=8 step skinny_prologues python3 benchmarks/gpu/bench_skinny.py --prologues --rows 1 4
TAIL=8 step mtp_no_prologue env PD_PROLOGUE=0 python3 benchmarks/bench_mtp.py --device cuda \
    --ks 0,3 --max-tokens 256 --repeats 3 --logprobs off --overlap on
TAIL=13 step structured python3 benchmarks/bench_structured.py --device cuda --synthetic-1b \
    --batch 1 32 --max-tokens 128 --repeats 2 --grammars none json json-masked regex regex-masked
TAIL=24 step structured_steps python3 benchmarks/gpu/profile_structured.py --batch 32 \
    --grammars json none
# structured output's cost at batch 32, with the narrow-mask rule and without it (`--narrow 0`)
TAIL=6 step structured_b32 python3 benchmarks/bench_structured.py --device cuda --synthetic-1b \
    --batch 32 --max-tokens 128 --repeats 3 --grammars none json
TAIL=6 step structured_b32_narrow_off python3 benchmarks/bench_structured.py --device cuda \
    --synthetic-1b --batch 32 --max-tokens 128 --repeats 3 --grammars none json --narrow 0
fi
if [[ $PART == all || $PART == 4 ]]; then  # prefix caching through pd launch
TAIL=7 step host_step python3 benchmarks/bench_host_step.py --walks 32
TAIL=40 step host_calls python3 benchmarks/gpu/profile_launch.py --batch 1 64
TAIL=40 step host_calls_mtp python3 benchmarks/gpu/profile_launch.py --batch 1 16 --k 3 --logprobs 0
TAIL=24 step prefix_cache python3 benchmarks/bench_prefix_cache.py --device cuda --synthetic-1b \
    --prefix-len 2048 --input-len 128 --output-len 16 --num-prompts 64 --concurrency 8 \
    --first-turn-len 1024 --routing-prompts 320
TAIL=7 step serving python3 benchmarks/bench_serving.py --device cuda --synthetic-1b \
    --num-prompts 1024 --router-workers 4 --client-processes 4 --result-json "$OUT/serving.json"
TAIL=22 step serving_traced python3 benchmarks/bench_serving.py --device cuda --synthetic-1b \
    --num-prompts 1024 --router-workers 4 --client-processes 4 --no-engine --trace --slow-ms 20 \
    --launch-args="--log-level info"
TAIL=6 step serving_one_router python3 benchmarks/bench_serving.py --device cuda --synthetic-1b \
    --num-prompts 1024 --no-engine
TAIL=7 step serving_8_workers python3 benchmarks/bench_serving.py --device cuda --synthetic-1b \
    --num-prompts 1024 --router-workers 8 --client-processes 4 --launch-args=--mps --no-engine
# the serving goal's rows in turn, with the engine alone in each: MPS, the prefill at 50% of the
# multiprocessors, the prefill as a client of below-normal priority, both; the client in eight
# processes (each under a third of a core, so that its reading stays out of the gaps it measures)
serve_64() { python3 benchmarks/bench_serving.py --device cuda --synthetic-1b --num-prompts 1024 \
    --router-workers 8 --client-processes 8 "$@"; }
TAIL=9 step serving_mps serve_64 --launch-args=--mps
TAIL=9 step serving_mps_sm50 serve_64 "--launch-args=--mps --prefill-sm-percent 50"
TAIL=9 step serving_mps_low_priority serve_64 "--launch-args=--mps --prefill-low-priority"
TAIL=9 step serving_mps_sm50_low_priority serve_64 \
    "--launch-args=--mps --prefill-sm-percent 50 --prefill-low-priority"
TAIL=7 step serving_256 python3 benchmarks/bench_serving.py --device cuda --synthetic-1b \
    --concurrency 256 --num-prompts 1536 --router-workers 4 --client-processes 4
fi
if [[ $PART == 3 ]]; then  # needs two GPUs: P on cuda:0, D on cuda:1
TAIL=12 step kv_two_gpus timeout 300 python3 benchmarks/gpu/bench_kv.py --devices cuda:0,cuda:1
TAIL=24 step mixed python3 benchmarks/gpu/bench_mixed.py --stream-tokens 4096 --warmup 0.25 \
    --transports ipc shm zmq
fi
if [[ $PART == 5 ]]; then  # needs two GPUs: tensor parallelism (ranks on cuda:0 and cuda:1)
TAIL=4 step tp_pd env PD_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_tp_pd.py
TAIL=48 step tp python3 benchmarks/gpu/bench_tp.py --check --profile --batch 1 64 --timeout 150
fi
if [[ $PART == 6 ]]; then  # one GPU: the skinny product on Llama-3.1-8B's layers (TP's shapes)
TAIL=12 step skinny_8b python3 benchmarks/gpu/bench_skinny.py --model 8b --quick --rows 1 64
TAIL=12 step skinny_8b_tp2 python3 benchmarks/gpu/bench_skinny.py --model 8b-tp2 --quick --rows 1 64
fi
exit $status
