"""Tooling around the library, never imported by the core: the CLI (`spec-adapt`), benchmarks (`bench`,
`serve_bench`), the policy lab (`lab`), step-time profiling (`profiling`), model loading (`models`) and synthetic
test models (`synthetic`)."""
