"""Model definitions, kernels, loader, generation and verify reports (issue: runtime)."""
