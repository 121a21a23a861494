//! polar_fast._native: the Rust parts of polar_fast as Python sees them. This is the only file
//! that knows pyo3, and its `#[pymodule]` at the end is the one export list. The algorithms live
//! in plain-Rust modules with their own cargo tests, one per job:
//!   merge     the prefix-trie merge and micro-batch packing  (Python face: polar_fast/merge)
//!   tokenize  byte-level BPE identical to HF tokenizers      (polar_fast/capture/tokenizer.py)
//!   wire      JSON spans and id codecs of the proxy's bytes  (polar_fast/wire)
//!
//! Only plain data crosses: msgpack bytes or a list of record objects in, numpy arrays out (moved,
//! not copied). The heavy part runs with the GIL released (`py.detach`).

use numpy::{IntoPyArray, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

pub mod merge;
pub mod tokenize;
pub mod wire;

use merge::error::MergeError as RustMergeError;
use merge::record::Call;
use merge::{pack, record, trie};
use tokenize::bpe;
use wire::{ints, jsonscan};

pyo3::import_exception!(polar_fast.errors, MergeError);

fn to_py(err: RustMergeError) -> PyErr {
    MergeError::new_err(err.0)
}

fn calls_from_objects(calls: &Bound<'_, PyAny>) -> PyResult<Vec<Call>> {
    // getattr + extract with an error that names the call and the field
    macro_rules! field {
        ($item:expr, $c:expr, $name:literal) => {
            $item
                .getattr($name)
                .and_then(|v| v.extract())
                .map_err(|_| MergeError::new_err(format!("call {}: missing or mistyped {}", $c, $name)))?
        };
    }
    let mut out = Vec::new();
    for (c, item) in calls.try_iter()?.enumerate() {
        let item = item?;
        let prompt: Vec<i64> = field!(item, c, "prompt_ids");
        let completion: Vec<i64> = field!(item, c, "completion_ids");
        let logprobs: Vec<f64> = field!(item, c, "completion_logprobs");
        let call = Call::new(c, field!(item, c, "rollout_id"), &prompt, &completion, &logprobs,
                             field!(item, c, "policy_version"));
        out.push(call.map_err(to_py)?);
    }
    Ok(out)
}

fn layout_dict<'py>(py: Python<'py>, out: trie::Layout) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tokens", out.tokens.into_pyarray(py))?;
    d.set_item("positions", out.positions.into_pyarray(py))?;
    d.set_item("parent", out.parent.into_pyarray(py))?;
    d.set_item("size", out.size.into_pyarray(py))?;
    d.set_item("loss_mask", out.loss_mask.into_pyarray(py))?;
    d.set_item("logprobs", out.logprobs.into_pyarray(py))?;
    d.set_item("versions", out.versions.into_pyarray(py))?;
    d.set_item("rollout", out.rollout.into_pyarray(py))?;
    d.set_item("node", out.node.into_pyarray(py))?;
    d.set_item("offsets", out.offsets.into_pyarray(py))?;
    d.set_item("extra_index", out.extra_index.into_pyarray(py))?;
    d.set_item("extra_rollout", out.extra_rollout.into_pyarray(py))?;
    d.set_item("extra_logprob", out.extra_logprob.into_pyarray(py))?;
    d.set_item("extra_version", out.extra_version.into_pyarray(py))?;
    Ok(d)
}

fn stats_dict<'py>(py: Python<'py>, s: &trie::Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("n_calls", s.n_calls),
        ("n_rollouts", s.n_rollouts),
        ("n_nodes", s.n_nodes),
        ("n_output_tokens", s.n_output_tokens),
        ("n_call_tokens", s.n_call_tokens),
        ("n_samples", s.n_samples),
        ("n_extra_samples", s.n_extra_samples),
        ("n_leaves", s.n_leaves),
        ("extend", s.extend),
        ("new_root", s.new_root),
        ("in_completion", s.in_completion),
        ("in_prompt", s.in_prompt),
        ("completion_fork", s.completion_fork),
        ("duplicate", s.duplicate),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Merge a group's calls into one trie and flatten it; see polar_fast/merge/__init__.py.
#[pyfunction]
#[pyo3(name = "merge", signature = (calls, *, layout = "tree"))]
fn merge_calls<'py>(py: Python<'py>, calls: &Bound<'py, PyAny>, layout: &str) -> PyResult<Bound<'py, PyDict>> {
    let tree = match layout {
        "tree" => true,
        "paths" => false,
        other => return Err(MergeError::new_err(format!("layout must be 'tree' or 'paths', not {other:?}"))),
    };
    let (out, trie) = if let Ok(bytes) = calls.cast::<PyBytes>() {
        let payload = bytes.as_bytes();
        py.detach(|| -> Result<_, RustMergeError> {
            let mut reader = record::CallReader::new(payload)?;
            let mut trie = trie::Trie::new();
            let mut call = Call::default();
            while reader.read_into(&mut call)? {
                trie.insert(&mut call);
            }
            Ok(flatten(trie, tree))
        })
        .map_err(to_py)?
    } else {
        let mut calls = calls_from_objects(calls)?;
        py.detach(|| {
            let mut trie = trie::Trie::new();
            trie.insert_all(&mut calls);
            flatten(trie, tree)
        })
    };
    let d = layout_dict(py, out)?;
    d.set_item("rollout_ids", PyList::new(py, trie.rollout_ids())?)?;
    d.set_item("stats", stats_dict(py, trie.stats())?)?;
    Ok(d)
}

fn flatten(mut trie: trie::Trie, tree: bool) -> (trie::Layout, trie::Trie) {
    let out = if tree { trie.tree() } else { trie.paths() };
    (out, trie)
}

/// Micro-batch plans for merged arrays; see polar_fast/merge/__init__.py `pack_plans`.
#[pyfunction]
#[pyo3(signature = (parent, size, offsets, loss_mask, extra_index, *, layout, max_tokens))]
#[allow(clippy::too_many_arguments)]
fn pack_plan<'py>(
    py: Python<'py>,
    parent: PyReadonlyArray1<'py, i32>,
    size: PyReadonlyArray1<'py, i32>,
    offsets: PyReadonlyArray1<'py, i32>,
    loss_mask: PyReadonlyArray1<'py, u8>,
    extra_index: PyReadonlyArray1<'py, i32>,
    layout: &str,
    max_tokens: i64,
) -> PyResult<Bound<'py, PyList>> {
    let kind = match layout {
        "tree" => pack::LayoutKind::Tree,
        "paths" => pack::LayoutKind::Paths,
        other => return Err(MergeError::new_err(format!("layout must be 'tree' or 'paths', not {other:?}"))),
    };
    let input = pack::Input {
        parent: parent.as_slice()?,
        size: size.as_slice()?,
        offsets: offsets.as_slice()?,
        loss_mask: loss_mask.as_slice()?,
        extra_index: extra_index.as_slice()?,
    };
    let plans = py.detach(|| pack::pack_plans(&input, kind, max_tokens)).map_err(to_py)?;
    let out = PyList::empty(py);
    for plan in plans {
        let d = PyDict::new(py);
        d.set_item("index", plan.index.into_pyarray(py))?;
        d.set_item("parent", plan.parent.into_pyarray(py))?;
        d.set_item("size", plan.size.into_pyarray(py))?;
        d.set_item("loss_mask", plan.loss_mask.into_pyarray(py))?;
        d.set_item("offsets", plan.offsets.into_pyarray(py))?;
        d.set_item("extra_ids", plan.extra_ids.into_pyarray(py))?;
        d.set_item("extra_index", plan.extra_index.into_pyarray(py))?;
        out.append(d)?;
    }
    Ok(out)
}

/// Work on inputs shorter than this keeps the GIL. Releasing it is free, taking it back is not:
/// while another thread runs Python (a whole render in the proxy's pool) the caller waits up to
/// the interpreter's switch interval (5 ms) for a job of a few microseconds.
const DETACH_BYTES: usize = 16 * 1024;

fn detach_if<T: Send>(py: Python<'_>, detach: bool, f: impl FnOnce() -> T + Send + pyo3::marker::Ungil) -> T {
    if detach {
        py.detach(f)
    } else {
        f()
    }
}

/// A byte-level BPE tokenizer that encodes exactly as HF `tokenizers`; see polar_fast/capture/tokenizer.py.
#[pyclass(module = "polar_fast._native", frozen)]
struct BpeEncoder(bpe::BpeEncoder);

#[pymethods]
impl BpeEncoder {
    #[new]
    fn new(py: Python<'_>, tokenizer_json: &str) -> PyResult<Self> {
        py.detach(|| bpe::BpeEncoder::from_json(tokenizer_json))
            .map(BpeEncoder)
            .map_err(pyo3::exceptions::PyValueError::new_err)
    }

    fn encode(&self, py: Python<'_>, text: &str) -> Vec<u32> {
        detach_if(py, text.len() >= DETACH_BYTES, || self.0.encode(text))
    }

    fn encode_many(&self, py: Python<'_>, texts: Vec<String>) -> Vec<Vec<u32>> {
        let long = texts.iter().map(String::len).sum::<usize>() >= DETACH_BYTES;
        detach_if(py, long, || texts.iter().map(|t| self.0.encode(t)).collect())
    }

    /// The ids of `encode(text)` as native-endian int32 bytes, for `array("i").frombytes`: no
    /// Python int per token.
    fn encode_bytes<'py>(&self, py: Python<'py>, text: &str) -> Bound<'py, PyBytes> {
        let ids = detach_if(py, text.len() >= DETACH_BYTES, || self.0.encode(text));
        PyBytes::new(py, &ints::ne_int32_bytes(&ids))
    }
}

/// CRC-32 (zlib's polynomial, so `zlib.crc32(data)`) of a record frame, with SIMD folding.
#[pyfunction]
fn crc32(py: Python<'_>, data: &[u8]) -> u32 {
    detach_if(py, data.len() >= 64 * DETACH_BYTES, || crc32fast::hash(data))
}

/// (start, end) byte offsets of top-level `key`'s value in a JSON object; see wire/jsonscan.rs.
#[pyfunction]
fn json_value_span(body: &[u8], key: &str) -> Option<(usize, usize)> {
    jsonscan::top_level_value(body, key.as_bytes())
}

/// The (start, end) offsets of an array's elements and of its closing bracket; see wire/jsonscan.rs.
#[pyfunction]
#[pyo3(signature = (body, at, *, after_item = false))]
fn json_array_items(body: &[u8], at: usize, after_item: bool) -> Option<(Vec<(usize, usize)>, usize)> {
    jsonscan::array_items(body, at, after_item)
}

fn int32_cells<'a>(py: Python<'a>, ids: &'a pyo3::buffer::PyBuffer<i32>) -> PyResult<&'a [pyo3::buffer::ReadOnlyCell<i32>]> {
    #[allow(deprecated)] // its replacement is an unsafe pointer; the cells are read-only views
    ids.as_slice(py)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("ids must be a contiguous int32 buffer"))
}

/// MessagePack of a list of int32 (what msgspec writes for `list(ids)`), straight from an
/// `array("i")`; see wire/ints.rs.
#[pyfunction]
fn msgpack_int32s<'py>(py: Python<'py>, ids: pyo3::buffer::PyBuffer<i32>) -> PyResult<Bound<'py, PyBytes>> {
    let cells = int32_cells(py, &ids)?;
    Ok(PyBytes::new(py, &ints::msgpack_int32s(cells.iter().map(|c| c.get()))))
}

/// Length of the longest common prefix of two byte strings.
#[pyfunction]
fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    jsonscan::common_prefix_len(a, b)
}

/// JSON of a list of int32 (what msgspec writes for `list(ids)`: `[1,2,3]`), straight from an
/// `array("i")`; see wire/ints.rs.
#[pyfunction]
fn json_int32s<'py>(py: Python<'py>, ids: pyo3::buffer::PyBuffer<i32>) -> PyResult<Bound<'py, PyBytes>> {
    let cells = int32_cells(py, &ids)?;
    Ok(PyBytes::new(py, &ints::json_int32s(cells.iter().map(|c| c.get()))))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(merge_calls, m)?)?;
    m.add_function(wrap_pyfunction!(crc32, m)?)?;
    m.add_function(wrap_pyfunction!(json_value_span, m)?)?;
    m.add_function(wrap_pyfunction!(json_array_items, m)?)?;
    m.add_function(wrap_pyfunction!(common_prefix_len, m)?)?;
    m.add_function(wrap_pyfunction!(msgpack_int32s, m)?)?;
    m.add_function(wrap_pyfunction!(json_int32s, m)?)?;
    m.add_function(wrap_pyfunction!(pack_plan, m)?)?;
    m.add_class::<BpeEncoder>()?;
    m.add("MergeError", m.py().import("polar_fast.errors")?.getattr("MergeError")?)?;
    Ok(())
}
