// Specgate console: the in-browser receipt check. It trusts nothing the server concluded:
// from the event's canonical bytes, the inclusion proof, the signed checkpoint note and the
// log's public key (all shown on the page) it recomputes, with WebCrypto,
//   1. the event's chain hash, SHA-256(canonical bytes), against the event_hash it states;
//   2. the RFC 9162 leaf hash, SHA-256(0x00 || canonical bytes);
//   3. the root from the leaf and the proof (RFC 9162 section 2.1.3.2, node hash
//      SHA-256(0x01 || left || right)) against the checkpoint's root, at the checkpoint's size;
//   4. the checkpoint's Ed25519 signature (C2SP signed-note) with the public key in the box.
// The verdict is "verified" only if every step passes. No other code runs on any page.
"use strict";

(function () {
  const enc = new TextEncoder();

  function b64ToBytes(text) {
    const binary = atob(text);
    const out = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
    return out;
  }

  function bytesToB64(bytes) {
    let binary = "";
    for (const b of bytes) binary += String.fromCharCode(b);
    return btoa(binary);
  }

  function hex(bytes) {
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function concat(parts) {
    const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) {
      out.set(p, at);
      at += p.length;
    }
    return out;
  }

  async function sha256(...parts) {
    return new Uint8Array(await crypto.subtle.digest("SHA-256", concat(parts)));
  }

  const leafHash = (data) => sha256(Uint8Array.of(0), data);
  const nodeHash = (left, right) => sha256(Uint8Array.of(1), left, right);

  function equal(a, b) {
    return a.length === b.length && a.every((x, i) => x === b[i]);
  }

  // Tree sizes may pass 2^31: halve with arithmetic, not bit operators.
  const odd = (n) => n % 2 === 1;
  const half = (n) => Math.floor(n / 2);

  async function verifyInclusion(index, size, leaf, proof, root) {
    if (!(Number.isSafeInteger(index) && Number.isSafeInteger(size) && index >= 0 && index < size)) {
      throw new Error(`leaf index ${index} is outside a tree of size ${size}`);
    }
    let fn = index;
    let sn = size - 1;
    let digest = leaf;
    for (const sibling of proof) {
      if (sibling.length !== 32) throw new Error("a proof hash is not 32 bytes");
      if (sn === 0) throw new Error("the inclusion proof is longer than the tree is deep");
      if (odd(fn) || fn === sn) {
        digest = await nodeHash(sibling, digest);
        while (!odd(fn) && fn !== 0) {
          fn = half(fn);
          sn = half(sn);
        }
      } else {
        digest = await nodeHash(digest, sibling);
      }
      fn = half(fn);
      sn = half(sn);
    }
    if (sn !== 0) throw new Error("the inclusion proof is shorter than the tree is deep");
    if (!equal(digest, root)) throw new Error("the inclusion proof does not lead to the checkpoint's root");
  }

  function parseNote(text) {
    const split = text.indexOf("\n\n");
    if (split < 0 || !text.endsWith("\n")) throw new Error("the checkpoint note has no signature block");
    const body = text.slice(0, split + 1);
    const lines = body.slice(0, -1).split("\n");
    if (lines.length !== 3 || !/^(0|[1-9][0-9]*)$/.test(lines[1])) {
      throw new Error("the checkpoint body is not origin, size, root");
    }
    const root = b64ToBytes(lines[2]);
    if (root.length !== 32 || bytesToB64(root) !== lines[2]) throw new Error("the root is not 32 bytes of base64");
    const signatures = text
      .slice(split + 2, -1)
      .split("\n")
      .map((line) => {
        if (!line.startsWith("\u2014 ")) throw new Error("a signature line is malformed");
        const [name, value] = line.slice(2).split(" ");
        return { name, value: b64ToBytes(value) };
      });
    return { body, origin: lines[0], size: Number(lines[1]), root, signatures };
  }

  async function verifySignature(note, pem) {
    const der = b64ToBytes(pem.replace(/-----[A-Z ]+-----/g, "").replace(/\s+/g, ""));
    if (der.length !== 44) throw new Error("the public key is not an Ed25519 SubjectPublicKeyInfo");
    const raw = der.slice(12);
    const keyHash = (await sha256(enc.encode(note.origin + "\n"), Uint8Array.of(1), raw)).slice(0, 4);
    const mine = note.signatures.find((s) => s.name === note.origin && equal(s.value.slice(0, 4), keyHash));
    if (!mine) throw new Error("the checkpoint carries no signature by this public key");
    const key = await crypto.subtle.importKey("spki", der, { name: "Ed25519" }, false, ["verify"]);
    const ok = await crypto.subtle.verify({ name: "Ed25519" }, key, mine.value.slice(4), enc.encode(note.body));
    if (!ok) throw new Error("the checkpoint's signature does not verify with this public key");
  }

  async function check(receipt, pem, report) {
    const canonical = b64ToBytes(receipt.canonical);
    const chain = hex(await sha256(canonical));
    if (chain !== receipt.event_hash) throw new Error("the event's bytes do not hash to its event_hash");
    const event = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(canonical));
    if (event.seq !== receipt.leaf_index + 1) throw new Error("the leaf index is not the event's seq - 1");
    report(`chain hash ${chain.slice(0, 16)}... recomputed from the event's canonical bytes`);
    const leaf = await leafHash(canonical);
    report(`leaf hash ${bytesToB64(leaf)}`);
    const note = parseNote(receipt.checkpoint);
    if (note.size !== receipt.tree_size) throw new Error("the proof is not for the checkpoint's tree size");
    const proof = receipt.inclusion_proof.map(b64ToBytes);
    await verifyInclusion(receipt.leaf_index, note.size, leaf, proof, note.root);
    report(`leaf ${receipt.leaf_index} is in the tree of ${note.size} events (root ${bytesToB64(note.root)})`);
    await verifySignature(note, pem);
    report(`the checkpoint is signed by ${note.origin} with the public key shown`);
  }

  async function run() {
    const data = document.getElementById("receipt-data");
    const verdict = document.getElementById("browser-verdict");
    const steps = document.getElementById("browser-steps");
    const keyBox = document.getElementById("public-key");
    if (!data || !verdict || !steps || !keyBox) return;
    steps.textContent = "";
    verdict.dataset.verdict = "running";
    verdict.textContent = "checking...";
    const report = (text) => {
      const item = document.createElement("li");
      item.textContent = text;
      steps.appendChild(item);
    };
    try {
      await check(JSON.parse(data.textContent), keyBox.value, report);
      verdict.dataset.verdict = "verified";
      verdict.textContent = "VERIFIED in this browser";
    } catch (error) {
      report(`failed: ${error.message}`);
      verdict.dataset.verdict = "failed";
      verdict.textContent = "FAILED in this browser";
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    const button = document.getElementById("verify-button");
    if (button) button.addEventListener("click", run);
    run();
  });
})();
