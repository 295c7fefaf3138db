#!/usr/bin/env bash
# Open or update the pull request of a tracking run (.github/workflows/track-upstream.yml),
# its body the run's report, after the workflow pushed BRANCH:
#   ready         a pull request for review, "Track vLLM <V>"
#   needs-person  a draft labelled needs-person, "Track vLLM <V>: needs a person"
# A pull request already open for BRANCH is edited, and made a draft or ready to match.
# Usage: STATUS=… VERSION=… BRANCH=… BASE=… track-pr.sh REPORT.md   (gh reads GH_TOKEN)
set -euo pipefail
body=${1:?usage: track-pr.sh REPORT.md}
: "${STATUS:?}" "${VERSION:?}" "${BRANCH:?}" "${BASE:?}"
label=needs-person

case $STATUS in
  ready) title="Track vLLM $VERSION" ;;
  needs-person) title="Track vLLM $VERSION: needs a person" ;;
  *) echo "track-pr.sh: no pull request for status '$STATUS'" >&2; exit 1 ;;
esac

# The label must exist before a pull request is given it or loses it (--force: no error
# when it does).
gh label create "$label" --force --color D93F0B \
  --description "a tracking run stopped: a person must finish the rebase"
number=$(gh pr list --head "$BRANCH" --base "$BASE" --state open --json number \
  --jq '.[0].number // empty')

if [ -z "$number" ] && [ "$STATUS" = needs-person ]; then
  gh pr create --base "$BASE" --head "$BRANCH" --title "$title" --body-file "$body" \
    --draft --label "$label"
elif [ -z "$number" ]; then
  gh pr create --base "$BASE" --head "$BRANCH" --title "$title" --body-file "$body"
elif [ "$STATUS" = needs-person ]; then
  gh pr edit "$number" --title "$title" --body-file "$body" --add-label "$label"
  gh pr ready "$number" --undo
else
  gh pr edit "$number" --title "$title" --body-file "$body" --remove-label "$label"
  gh pr ready "$number"
fi
