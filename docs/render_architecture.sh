#!/bin/sh
# Render docs/architecture.md's picture from its text source (graphviz, offline):
#   docs/render_architecture.sh        # needs `dot` (apt-get install graphviz)
set -eu
cd "$(dirname "$0")"
dot -Tsvg architecture.dot -o architecture.svg
dot -Tpng -Gdpi=110 architecture.dot -o architecture.png
echo "wrote docs/architecture.svg and docs/architecture.png"
