"""HTTP frontend: SGLang-native and OpenAI-compatible endpoints, Prometheus metrics."""
