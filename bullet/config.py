"""Server configuration: one pydantic model, with SGLang's flag names where they overlap
(`--model-path`, `--host`, `--port`, `--page-size`, `--max-total-tokens`, …). The CLI builds its
flags from the field descriptions here, so `--help` and validation never drift apart."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bullet.types.slo import parse_duration
from engines.chat_templates import read_template
from engines.cpuset import parse_id_list


class ServerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model
    model_path: str | None = Field(None, description="a .gguf file, an HF directory, or a config for "
                                   "--load-format dummy (default: the embedded SmolLM2-135M-Instruct)")
    tokenizer_path: str | None = Field(None, description="HF tokenizer directory (default: the model's own)")
    chat_template: str | None = Field(None, description="the chat template for /v1/chat/completions instead of the "
                                      "model's: a Jinja file, or a shipped one by name: chatml-tools (ChatML models such "
                                      "as the embedded SmolLM2, whose own template has no tools) | llama3-tools")
    tool_call_parser: Literal["auto", "hermes", "llama3"] = Field(
        "auto", description="how a chat reply's tool calls are read: hermes (<tool_call>{json}</tool_call>, ChatML and "
        "Qwen templates) | llama3 (a bare JSON object {\"name\", \"parameters\"}) | auto (from the chat template)")
    load_format: Literal["auto", "gguf", "safetensors", "dummy"] = Field("auto", description="weight format")
    dtype: str = Field("auto", description="auto (bf16 where the hardware has it, else fp32) | float32 | bfloat16 | float16")
    kv_cache_dtype: Literal["auto", "float16", "fp16", "bfloat16", "bf16", "float32", "fp32"] = Field(
        "auto", description="what the KV pool stores: auto (the model's compute dtype; float32 for the int8 model) | "
        "float16 | bfloat16 | float32 (float16 halves the bytes each decode step reads, and the pool's size)")
    quantization: str = Field("auto", description="auto (int8 W8A8 for a quantized GGUF on a CPU when --dtype is "
                              "auto and --tp-size is 1; an FP8 checkpoint kept in FP8 on CUDA, dequantized on a CPU; else none) | none (dequantize to "
                              "--dtype) | w8a8_int8 | fp8 (the attention and dense-MLP projections in FP8 e4m3: an FP8 checkpoint's as "
                              "stored; a float checkpoint's (safetensors, F32/F16/BF16 GGUF, dummy) quantized at load, one "
                              "scale per output row; not with a quantized GGUF or --tp-size > 1)")
    device: str = Field("cpu", description="cpu | cuda | cuda:<index> | auto (a GPU if one is visible)")
    served_model_name: str | None = Field(None, description="model name reported by the API (default: from the path)")
    seed: int = Field(0, description="seed for dummy weights")
    # HTTP
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port (0 = pick a free one)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on every request")
    max_request_body_bytes: int = Field(16 << 20, ge=1024, description="largest HTTP request body accepted; a larger "
                                        "one gets 413 before it is read (16 MiB holds a 128k-token prompt many times over)")
    timeout_keep_alive: float = Field(65.0, gt=0.0, description="seconds an idle HTTP connection stays open for the "
                                      "client's next request (uvicorn's flag). Longer than clients keep idle pooled "
                                      "connections (aiohttp 15 s, httpx 5 s) and proxies (often 60 s), so the client "
                                      "lets go first: with uvicorn's 5 s, a request a client sent on a connection idle "
                                      "for 5 s met the server closing it and was lost (ServerDisconnectedError)")
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per worker: the prefill and the decode worker "
                         "each run as this many processes, rank i of both holding the i-th shard of the weights and of "
                         "the KV pool (Megatron-style: heads and MLP width split, partial sums all-reduced through gloo) "
                         "and the i-th part of their worker's cores (CPU only for now; float weights)")
    # memory
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    max_total_tokens: int = Field(32768, ge=64, description="KV pool capacity in tokens (shared by both workers)")
    max_running_requests: int = Field(64, ge=1, description="most requests running at once (decoding, or in a "
                                      "prefill batch); prompts beyond it wait in the queue, before their first token")
    max_queued_requests: int = Field(1024, ge=1, description="requests the server holds at once, queued or running; "
                                     "past it a new request gets 503 with Retry-After, and a batch larger than "
                                     "this gets 400 (it could never be admitted)")
    max_prefill_tokens: int = Field(4096, ge=16, description="largest prefill batch, in prompt tokens")
    disable_radix_cache: bool = Field(False, description="free every request's KV pages when it finishes instead of "
                                      "keeping full pages in the prefix (radix) cache for later prompts that begin "
                                      "the same way")
    # scheduling
    policy: str = Field("bullet", description="bullet (measures and caches a quick estimator profile on first use) | "
                        "static[:<prefill units>] | naive | chunked:<token budget> "
                        "(decodes and prefill chunks fused in each step) | sglang:<token budget> (SGLang's default: "
                        "prefill chunks first, decode otherwise) | partition-only / scheduler-only (Bullet's "
                        "dynamic split alone / its request scheduling alone: the paper's ablation)")
    enable_priority_scheduling: bool = Field(
        False, description="serve requests by their `priority` field: a higher value is admitted and prefilled first "
        "under every policy, equal priorities in arrival order (SGLang's flag; off: every request in arrival order, "
        "and a request with a priority other than null or 0 is refused)")
    prefill_layers_per_step: int = Field(4, ge=1, description="layers a prefill step runs before the scheduler runs again")
    partition_backend: Literal["auto", "cpu", "libsmctrl", "green-ctx", "mps-percentage", "none"] = Field(
        "auto", description="how compute units are divided between the workers: auto (cpu on a CPU; on a GPU the "
        "first of green-ctx, libsmctrl, mps-percentage that `bullet doctor` measured keeping the two workers on "
        "disjoint SMs on this GPU, driver and MPS state, else green-ctx) | cpu | libsmctrl | green-ctx | "
        "mps-percentage (MPS's per-worker SM cap, fixed at start) | none")
    partition_pool: Literal["coarse", "all"] = Field(
        "coarse", description="green-ctx: the SM shares each worker's pool offers — coarse (splits at 1/8, 1/4, 1/2 "
        "and 3/4 of the groups from either side: few shares, so decode's per-share CUDA graphs can all be captured "
        "at start) or all (every multiple of the driver's group)")
    cores: str | None = Field(None, description="CPU cores the server may use, e.g. '0-3' (default: all allowed)")
    ttft_slo: str = Field("3.0ms/token", description="TTFT target: absolute ('2s', '500ms') or per input token ('3ms/token')")
    tpot_slo: str = Field("150ms", description="TPOT target ('150ms', '0.2s')")
    tbt_slo: str | None = Field(None, description="bound on the gap between two tokens of a request ('100ms'): "
                                "scored as each request's P99 gap, and the bullet decode policy never pauses for a "
                                "prefill burst past it (default: none; TPOT alone bounds the pauses)")
    prefill_preemption: bool = Field(True, description="bullet: a queued prompt that would miss its TTFT behind the "
                                     "prefill batch in flight runs first, at the next layer boundary, when that costs "
                                     "the batch none of its TTFT targets")
    hand_back: Literal["off", "decode-step", "bounded"] = Field(
        "bounded", description="bullet: units the last layer group of a prefill batch gives back to decode when no "
        "prompt waits: off | decode-step (stretch it by one decode step on the complement) | bounded (by <= 10%%)")
    layer_group: Literal["fixed", "adaptive"] = Field(
        "fixed", description="bullet: layers per prefill step: fixed (--prefill-layers-per-step) or adaptive (as many "
        "as take about one decode step, at least 10 ms' worth)")
    split_rule: Literal["spatial", "aggregate"] = Field(
        "spatial", description="bullet: while TPOT has slack, decode keeps the fewest units that hold it (spatial) or "
        "pauses and prefill takes every unit as long as its pause budget covers the step (aggregate: DuetServe's rule, "
        "split only when TPOT would break)")
    split_goal: Literal["prefill-first", "throughput"] = Field(
        "prefill-first", description="bullet, while TPOT has slack: decode gets the fewest units that keep it and "
        "prefill the rest (prefill-first); or, while TTFT holds too, the split that gets the most work done per "
        "second (each phase's speed on its share against its speed on the whole device, summed) among those that "
        "keep TPOT and slow prefill no more than its requests' TTFT slack allows (throughput: more work per "
        "second, but on the measured H200 it cost TTFT, which bounds goodput there: docs/sim/ledger.md)")
    slo_percentile: float = Field(
        0.9, gt=0.0, le=1.0, description="bullet: the percentile of its requests' predicted TTFT (against target) and "
        "TPOT that each scheduler keeps within its SLO (0.9: the P90, the paper's rule). Goodput counts the requests "
        "that meet both targets, so two P90s can leave fewer than 90%% meeting both")
    idle_decode_units: Literal["all", "efficient"] = Field(
        "all", description="bullet: while prefill is idle decode takes every unit (all), or the fewest whose step is "
        "predicted within 10%% of that (efficient), leaving the rest free for the next prompt")
    decode_tail_share: bool = Field(
        True, description="bullet: when prefill's batch is predicted to end early in decode's next step with "
        "nothing queued behind it, decode starts that step on every unit (sharing prefill's last layers) instead "
        "of the complement of prefill's share, which would idle prefill's units from its end to the step's")
    prefill_grow: Literal["after-decode-step", "at-once"] = Field(
        "after-decode-step", description="bullet: when prefill's new share reaches into units a running decode step "
        "holds (a burst takes every unit), prefill runs beside that step's units until it ends and decode's next step "
        "takes the complement of the new share (after-decode-step), or takes them at once and the rest of the step "
        "shares them (at-once, the rule before). In the simulator on the measured H200 a decode step whose units a "
        "burst of long prompts took crawled from 30 ms to 780 ms: docs/sim/ledger.md")
    decode_yield_at: Literal["layer", "step"] = Field(
        "layer", description="bullet: when prefill starts on units a running decode step holds, decode gives them up "
        "at its next layer boundary (layer: where decode runs layer by layer, i.e. on a CPU, not in CUDA-graph "
        "replays) or when the step ends (step, the rule before)")
    estimator_profile: str | None = Field(None, description="profile written by `bullet profile` (default: measured on first use)")
    timeline_dir: str | None = Field(None, description="write every scheduling decision to <dir>/<role>.jsonl")
    # supervision
    max_worker_restarts: int = Field(3, ge=0, description="restarts after a worker dies before the server gives up")
    heartbeat_timeout: float = Field(30.0, ge=0.0, description="a worker that publishes no heartbeat for this many "
                                     "seconds (stopped, deadlocked) is killed, its requests fail, and it is restarted "
                                     "(0 = never; raise it for models whose single steps take longer)")
    shutdown_timeout: float = Field(30.0, ge=0.0, description="on SIGTERM/SIGINT: stop admitting (503), give requests "
                                    "in flight this many seconds to finish, then end the rest with an error")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v):
        # a torch.device is accepted by its name ("cuda:0"; the policy layer imports this model, so
        # no torch here); the launcher resolves the name once (bullet.launcher.device_choice) and
        # hands the workers a torch.device
        v = v if isinstance(v, str) else str(v)
        kind, colon, index = v.partition(":")
        if kind not in ("cpu", "cuda", "auto") or (colon and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"unknown device {v!r}; choose cpu, cuda, cuda:<index> or auto")
        return v

    @field_validator("ttft_slo", "tpot_slo", "tbt_slo")
    @classmethod
    def _slo_parses(cls, value, info):
        if value is None:
            return value
        parse_duration(value, allow_per_token=info.field_name == "ttft_slo")  # a clear error at launch, not in a worker
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v):
        if v is not None:
            read_template(v)  # a missing file is an error at start-up, not at the first chat request
        return v

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        name, _, arg = v.partition(":")
        if name not in ("bullet", "static", "naive", "chunked", "sglang", "partition-only", "scheduler-only"):
            raise ValueError(f"unknown policy {v!r}; choose bullet, static[:<units>], naive, chunked:<tokens>, "
                             "sglang:<tokens>, partition-only or scheduler-only")
        if name in ("partition-only", "scheduler-only") and arg:
            raise ValueError(f"{name} takes no argument")
        if name in ("chunked", "sglang") and not arg.isdigit():
            raise ValueError(f"{name} needs a token budget, e.g. {name}:256")
        if arg and not arg.isdigit():
            raise ValueError(f"policy argument must be a number, got {arg!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        if self.tp_size > 1 and self.quantization in ("w8a8_int8", "fp8"):
            # the ranks split float matrices by rows and columns (engines.tensor_parallel); refused here,
            # before a model is read, rather than after the load
            raise ValueError(f"--tp-size {self.tp_size} serves float weights: --quantization {self.quantization} "
                             "is not split across ranks (use --quantization none or auto, or --tp-size 1)")
        return self

    @property
    def policy_name(self) -> str:
        return self.policy.partition(":")[0]

    @property
    def uses_estimator(self) -> bool:
        """Bullet's policy, or one of its halves (the ablation): they predict with the estimator."""
        return self.policy_name in ("bullet", "partition-only", "scheduler-only")

    @property
    def policy_arg(self) -> int | None:
        arg = self.policy.partition(":")[2]
        return int(arg) if arg else None

    @property
    def num_pages(self) -> int:
        return -(-self.max_total_tokens // self.page_size)

    def allowed_cores(self) -> list[int]:
        allowed = sorted(os.sched_getaffinity(0))
        if self.cores is None:
            return allowed
        wanted = sorted(parse_id_list(self.cores))
        missing = set(wanted) - set(allowed)
        if missing:
            raise ValueError(f"--cores {self.cores}: cores {sorted(missing)} are not available to this process")
        return wanted
