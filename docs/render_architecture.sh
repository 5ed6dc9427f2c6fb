#!/bin/sh
# The architecture picture, from the code: docs/architecture.py writes architecture.dot from the
# imports of uniun_ray, then graphviz renders it (offline):
#   docs/render_architecture.sh        # needs `dot` (apt-get install graphviz)
set -eu
cd "$(dirname "$0")"
"${PYTHON:-python3}" architecture.py
dot -Tsvg architecture.dot -o architecture.svg
dot -Tpng -Gdpi=110 architecture.dot -o architecture.png
echo "wrote docs/architecture.svg and docs/architecture.png"
