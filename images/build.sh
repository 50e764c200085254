#!/usr/bin/env bash
# Build (and optionally push) every runtime image, all tagged with the one version in pyproject.toml. Each image is
# one build target of images/Dockerfile: docker build -f images/Dockerfile --target IMAGE.
#
# Usage: images/build.sh [--push] [--dry-run] [--reward-gpu] [IMAGE...]
#   IMAGE        some of: trainer reward-server components vllm-judge mlflow (default: all)
#   --push       push each tag after it is built
#   --dry-run    print the docker commands instead of running them
#   --reward-gpu also build the reward server on torch's CUDA build, tagged VERSION-gpu
# Environment:
#   REGISTRY     image name prefix (default ghcr.io/flowgrpo): REGISTRY/flowgrpo-IMAGE:VERSION
#   DOCKER       the docker-compatible CLI (default docker; BuildKit is needed for `# syntax=`)
#   PLATFORM     target platform (default linux/amd64: the torch and vLLM wheels used are x86_64 builds)
#
# The build context is the repository root (.dockerignore keeps it to the package sources and the requirements
# files of images/).
# The manifests and the `cluster.image` of the example configs name ghcr.io/flowgrpo/...:VERSION; with another
# REGISTRY, set cluster.image and the kustomize `images:` of your overlay to match.
set -euo pipefail
cd "$(dirname "$0")/.."

# The build targets of images/Dockerfile that are images (its other stages are shared build and runtime stages).
all_images=(trainer reward-server components vllm-judge mlflow)
# torch's build for reward-server (the Dockerfile's default, PyPI, is the CUDA build the trainer uses).
torch_cpu_index=https://download.pytorch.org/whl/cpu
torch_cuda_index=https://pypi.org/simple
registry=${REGISTRY:-ghcr.io/flowgrpo}
docker=${DOCKER:-docker}
platform=${PLATFORM:-linux/amd64}
push=0
dry_run=0
reward_gpu=0
images=()
is_image() {  # is_image NAME: NAME is one of all_images
    local name
    for name in "${all_images[@]}"; do
        [ "$name" = "$1" ] && return 0
    done
    return 1
}

for arg in "$@"; do
    case "$arg" in
        --push) push=1 ;;
        --dry-run) dry_run=1 ;;
        --reward-gpu) reward_gpu=1 ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;  # the comment block above
        -*) echo "build.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
        *)
            if ! is_image "$arg"; then
                echo "build.sh: no image '$arg'; one of: ${all_images[*]}" >&2
                exit 2
            fi
            images+=("$arg") ;;
    esac
done
[ "${#images[@]}" -gt 0 ] || images=("${all_images[@]}")

version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
if [ -z "$version" ]; then
    echo "build.sh: no version = \"...\" in pyproject.toml" >&2
    exit 1
fi
git_commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$git_commit" != unknown ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
    git_commit="$git_commit-dirty"  # recorded in the image label and as the MLflow lineage tag
fi

run() {
    if [ "$dry_run" = 1 ]; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

build() {  # build IMAGE TAG [docker build options...]: the target IMAGE of images/Dockerfile, tagged TAG
    local image=$1 tag=$2
    shift 2
    echo "build.sh: $tag" >&2
    run "$docker" build --platform "$platform" -f images/Dockerfile --target "$image" -t "$tag" \
        --build-arg "VERSION=$version" --build-arg "GIT_COMMIT=$git_commit" "$@" .
    if [ "$push" = 1 ]; then
        run "$docker" push "$tag"
    fi
}

for image in "${images[@]}"; do
    if [ "$image" = reward-server ]; then
        build "$image" "$registry/flowgrpo-$image:$version" --build-arg "TORCH_INDEX_URL=$torch_cpu_index"
        if [ "$reward_gpu" = 1 ]; then
            build "$image" "$registry/flowgrpo-$image:$version-gpu" --build-arg "TORCH_INDEX_URL=$torch_cuda_index"
        fi
    else
        build "$image" "$registry/flowgrpo-$image:$version"
    fi
done
