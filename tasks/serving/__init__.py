"""Serving a policy: what one answer is (request checks, a trace per answer, a version's weights) and the
alias-following server of make serve-model. Imports stages/common for the loaders."""
