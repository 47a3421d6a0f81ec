// attnlab's own stand-in for Web Workers when a page is opened from file://.
//
// Browsers refuse `new Worker("file:///...")`, so Material's search worker cannot start on a site
// opened from disk. Material's offline plugin fixes that with a shim fetched from unpkg.com; this
// file replaces it (its name contains "iframe-worker", so the plugin adds no CDN script), keeping the
// site free of any external host. The worker's script runs in a hidden same-origin iframe instead:
// messages cross as MessageEvents, and importScripts() loads scripts in order and returns a Promise,
// which Material's search worker awaits. Served over http(s), the browser's own Worker is kept.
(function () {
  "use strict";
  if (location.protocol !== "file:" || typeof EventTarget === "undefined") {
    return;
  }

  function copy(data) {
    return typeof structuredClone === "function" ? structuredClone(data) : JSON.parse(JSON.stringify(data));
  }

  class IFrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this._queue = [];
      this._scope = null;
      this._frame = document.createElement("iframe");
      this._frame.setAttribute("aria-hidden", "true");
      this._frame.tabIndex = -1;
      this._frame.style.display = "none";
      this._frame.srcdoc = "<!doctype html><meta charset='utf-8'><title>worker</title>";
      this._frame.addEventListener("load", () => this._start(new URL(url, location.href).href), { once: true });
      (document.body || document.documentElement).appendChild(this._frame);
    }

    _start(src) {
      const scope = this._frame.contentWindow;
      const worker = this;
      // what the worker sends reaches the page as a "message" event on this object
      scope.postMessage = function (data) {
        const event = new MessageEvent("message", { data: copy(data) });
        setTimeout(() => {
          if (typeof worker.onmessage === "function") {
            worker.onmessage(event);
          }
          worker.dispatchEvent(event);
        }, 0);
      };
      scope.importScripts = function (...urls) {
        return urls.reduce((done, next) => done.then(() => load(scope.document, next)), Promise.resolve());
      };
      load(scope.document, src).then(
        () => {
          this._scope = scope;
          this._queue.splice(0).forEach((data) => this._deliver(data));
        },
        (error) => {
          const event = new ErrorEvent("error", { message: String(error) });
          if (typeof this.onerror === "function") {
            this.onerror(event);
          }
          this.dispatchEvent(event);
        },
      );
    }

    _deliver(data) {
      const scope = this._scope;
      setTimeout(() => scope.dispatchEvent(new scope.MessageEvent("message", { data: copy(data) })), 0);
    }

    postMessage(data) {
      if (this._scope) {
        this._deliver(data);
      } else {
        this._queue.push(data);
      }
    }

    terminate() {
      this._frame.remove();
      this._scope = null;
      this._queue = [];
    }
  }

  function load(doc, src) {
    return new Promise((resolve, reject) => {
      const script = doc.createElement("script");
      script.src = src;
      script.onload = () => resolve();
      script.onerror = () => reject(new Error("could not load " + src));
      doc.head.appendChild(script);
    });
  }

  window.IFrameWorker = IFrameWorker;
  window.Worker = IFrameWorker;
})();
