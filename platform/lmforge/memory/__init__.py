"""Where every byte of a rank goes, before launch: model states (`states`),
activations (`activations`), and the per-rank breakdown built from them (`estimate`)."""
