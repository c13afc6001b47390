#include "parallel/comm_thread.h"

#include "core/comm.h"
#include "core/fault.h"
#include "core/timer.h"

namespace moetrain {

CommThread::CommThread() : thread_([this] { loop(); }) {}

CommThread::~CommThread() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return finished_ == posted_; });
    stop_ = true;
  }
  work_.notify_one();
  thread_.join();
}

CommThread::Ticket CommThread::post(std::function<void()> task) {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
    t = ++posted_;
  }
  work_.notify_one();
  return t;
}

void CommThread::wait(Ticket t) {
  Timer timer;
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return finished_ >= t || error_; });
  waited_ += timer.seconds();
  if (error_) std::rethrow_exception(error_);
}

void CommThread::drain() {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    t = posted_;
  }
  wait(t);
}

double CommThread::busy_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return busy_;
}

void CommThread::loop() {
  comm_poll_politely(true);  // this thread mostly waits for peers that are still computing
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr failed;
    Timer busy;
    if (!error_) {
      try {
        fault_comm_job();  // MOETRAIN_FAULT=comm_delay: a slow link, inside the job's time
        task();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    const double seconds = busy.seconds();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ += seconds;
      if (failed && !error_) error_ = failed;
      ++finished_;
    }
    done_.notify_all();
  }
}

}  // namespace moetrain
