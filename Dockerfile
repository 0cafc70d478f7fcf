# Apertus 1.5 served by vLLM's OpenAI-compatible server, with the apertus-plugins package installed
# into the official vLLM image (the plugin registers itself through its vllm.general_plugins entry point).
#
#   docker build -t apertus-plugins .
#   docker run --gpus all -p 8000:8000 -e HF_TOKEN -v ~/.cache/huggingface:/root/.cache/huggingface apertus-plugins
#
# The image serves swiss-ai/Apertus-v1.5-8B with both parsers (tool calls and thinking); arguments
# after the image name replace the model and the served name: `docker run ... apertus-plugins MODEL [FLAGS]`.
# The supported vLLM range is 0.32 to 0.34 (vllm_model.SUPPORTED_VLLM).
ARG VLLM_VERSION=v0.34.0
FROM vllm/vllm-openai:${VLLM_VERSION}

LABEL org.opencontainers.image.title="apertus-plugins" \
      org.opencontainers.image.description="Apertus 1.5 on vLLM with the apertus-plugins model, processor and parsers" \
      org.opencontainers.image.licenses="Apache-2.0"

WORKDIR /opt/apertus-plugins
COPY pyproject.toml setup.cfg README.md LICENSE ./
COPY apertus_plugins ./apertus_plugins
COPY vllm_model ./vllm_model
COPY eval_tasks ./eval_tasks
COPY megatron_patches ./megatron_patches
COPY verl_ext ./verl_ext
# the image's own vLLM stays: the vllm extra adds only what the plugin itself needs; the package
# installed is this checkout (its version is the one being built), hence no pin
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir ".[vllm]" \
    && python3 -c "import vllm_model; vllm_model.check_vllm_version()"

ENV HF_HOME=/root/.cache/huggingface
EXPOSE 8000
ENTRYPOINT ["vllm", "serve", "--enable-auto-tool-choice", "--tool-call-parser", "apertus", "--reasoning-parser", "apertus", "--host", "0.0.0.0", "--port", "8000"]
CMD ["swiss-ai/Apertus-v1.5-8B", "--served-model-name", "apertus"]
