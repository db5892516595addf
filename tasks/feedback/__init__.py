"""Human feedback: judgements as MLflow assessments, the review page, feedback intake (versioned batches and its
journal), collecting judgements into batches, and the feedback behind a version."""
