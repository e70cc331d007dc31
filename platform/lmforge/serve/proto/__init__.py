"""lmforge's gRPC API: completions.proto, and the modules `make proto` generates from it."""
