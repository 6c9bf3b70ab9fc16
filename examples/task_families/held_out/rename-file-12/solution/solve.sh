#!/bin/bash
# The reference solution, run in /app.
set -e
mv cedar.txt raven.txt
