"""The probe, child side: one short training in a fresh process. The only package that touches CUDA or NVML.

The parent reaches it through :class:`.evaluator.ProbeEvaluator` (which starts the child with
:mod:`.isolation`) and :func:`.device.detect_device` (NVML only, no CUDA context). Inside the child,
:mod:`.child` builds the model (:mod:`.model`) and the Trainer and measures the steady state (:mod:`.steady`),
memory (:mod:`.memory`), NVML telemetry (:mod:`.telemetry`) and model FLOPs (:mod:`.flops`), and :mod:`.summary`
turns what it measured into the result. :mod:`.preload` is what
the probe server imports once so each probe forks warm. Nothing here imports the search.
"""
