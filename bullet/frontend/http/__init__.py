"""The HTTP server of the frontend: SGLang-native and OpenAI-compatible endpoints, Prometheus metrics."""
