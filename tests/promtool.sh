#!/bin/sh
# Runs promtool with the given arguments (ctest: promtool.check_rules, promtool.test_rules).
# promtool missing: a failure in CI (CI=true), a skip (exit 77) elsewhere.
if ! command -v promtool >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
        echo "promtool not found (Debian package prometheus; scripts/deps.sh): in CI this fails" >&2
        exit 1
    fi
    echo "promtool not found: install the Debian package prometheus (scripts/deps.sh); skipped"
    exit 77
fi
exec promtool "$@"
